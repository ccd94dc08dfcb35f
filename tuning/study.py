"""The Optuna driver: one study per (GPU fingerprint, op, quant type, shape class, token
bucket).

Why one study per bucket rather than one per fingerprint: a sampler models one objective
landscape, and the landscapes differ per bucket (the best tile at n=16 is the worst at
n=4096, and their times differ by 100x); the pruned space differs too, and Optuna requires a
parameter's choices to stay fixed within a study. The fingerprint and template hash, the bucket, the space's
signature and the objective's version are all in the study name, so a study never mixes
measurements of different things, and re-running the same command finds the same studies
and resumes them.

Budget: `trials` counts measured trials per study (completed or failed on the GPU; neither
cheap skips of the sampler nor trials of dead workers count); `deadline` is a wall-clock end
for a list of studies, split evenly over the studies still to run, so time a study leaves
unused (its space was exhausted) goes to the next ones.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass, field

import optuna
from optuna.trial import TrialState

from . import fingerprint as fpmod
from .isolate import IsolatedRunner, TrialFailed
from .space import PATHS, Space, TuneKey, build, default_choice, params_of, seeds
from .storage import GRACE_S, HEARTBEAT_S, make_storage, reclaim_dead, worker_id

OBJECTIVE_VERSION = "v1"     # bump when what a trial measures changes (routing, weights, value)
MAX_IDLE = 25                # consecutive unmeasured proposals: the sampler has converged
TARGETS = {"gpu": "moeforge.tuning.objective:Handler", "standin": "moeforge.tuning.standin:Handler"}


@dataclass
class Task:
    """Everything a worker process needs (picklable: it crosses a spawn)."""
    keys: list[TuneKey]
    storage_url: str
    fingerprint: dict
    smem_limit: int
    trials: int | None = None
    deadline: float | None = None
    objective: str = "gpu"
    settings: dict = field(default_factory=dict)
    trial_timeout: float = 120.0
    prepare_timeout: float = 900.0
    heartbeat: int = HEARTBEAT_S
    grace: int = GRACE_S
    progress: bool = True
    position: int = 0
    label: str = "tuning"


def study_name(fp: dict, space: Space) -> str:
    return (f"moeforge.{OBJECTIVE_VERSION}.{fpmod.ident(fp)}.{fp['templates']}.{space.key.label}."
            f"{space.signature()}")


def measured(t) -> bool:
    if t.state == TrialState.COMPLETE:
        return "duplicate_of" not in t.user_attrs
    return t.state == TrialState.FAIL and "fail_reason" in t.user_attrs


def _frozen(params: dict) -> tuple:
    return tuple(sorted(params.items()))


class Evaluator:
    """Sends candidates to the isolated worker process; prepares its case once per key."""

    def __init__(self, task: Task):
        self.task = task
        self.runner = IsolatedRunner(TARGETS[task.objective])

    def __call__(self, key: TuneKey, choice, trial: int, study: str) -> dict:
        head = {"key": [key.op, key.qtype, list(key.shape), key.n], "settings": self.task.settings}
        if self.runner.state != key:
            self.runner.call({**head, "op": "prepare"}, self.task.prepare_timeout)
            self.runner.state = key
        return self.runner.call({**head, "op": "trial", "path": choice.path, "spec": choice.spec.to_dict(),
                                 "trial": trial, "study": study}, self.task.trial_timeout)

    def close(self) -> None:
        self.runner.close()


def _sampler() -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # multivariate/group/constant_liar are "experimental"
        # group: each path's knobs form their own space; constant_liar: parallel workers
        # treat each other's running trials as bad, and so spread out.
        return optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, n_startup_trials=6)


class StudyRun:
    def __init__(self, task: Task, space: Space, storage, evaluate, wid: str):
        self.task, self.space, self.key = task, space, space.key
        self.evaluate, self.wid = evaluate, wid
        self.name = study_name(task.fingerprint, space)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.study = optuna.create_study(study_name=self.name, storage=storage, sampler=_sampler(),
                                             direction="minimize", load_if_exists=True)
        self.draining = False
        self.last = None

    def objective(self, trial: optuna.Trial) -> float:
        trial.set_user_attr("worker", self.wid)
        path = trial.suggest_categorical("path", self.space.paths)
        params = {"path": path}
        for knob, values in self.space.knob_choices(path).items():
            params[f"{path}.{knob}"] = trial.suggest_categorical(f"{path}.{knob}", values)
        choice = self.space.lookup(params)
        if choice is None:
            trial.set_user_attr("skipped", "combination outside the pruned space")
            raise optuna.TrialPruned()
        sysattrs = self.study._storage.get_trial_system_attrs(trial._trial_id)
        fixed = "fixed_params" in sysattrs or "failed_trial" in sysattrs   # enqueued or a retry
        if self.draining and not fixed:
            trial.set_user_attr("skipped", "budget reached")
            raise optuna.TrialPruned()
        dup = self._duplicate(trial.number, params)
        if dup is not None:
            trial.set_user_attr("duplicate_of", dup.number)
            if dup.state == TrialState.COMPLETE:
                return dup.value
            raise optuna.TrialPruned()   # failed, or being measured by another worker
        trial.set_user_attr("spec", choice.spec.name)
        try:
            res = self.evaluate(self.key, choice, trial.number, self.name)
        except TrialFailed as e:
            trial.set_user_attr("fail_reason", str(e)[:1000])
            raise
        # One attribute, one commit: the measurements beside the value.
        trial.set_user_attr("result", {k: float(v) for k, v in res.items()
                                       if k != "value" and isinstance(v, (int, float))})
        return float(res["value"])

    def _duplicate(self, number: int, params: dict):
        want = _frozen(params)
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or _frozen(t.params) != want or "duplicate_of" in t.user_attrs:
                continue
            # Of two workers that drew the same candidate at once, the older trial goes on.
            if measured(t) or (t.state == TrialState.RUNNING and t.number < number):
                return t
        return None

    def _one(self) -> bool:
        """Run one trial; True when it measured something."""
        self.last = None
        try:
            self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,),
                                callbacks=[lambda s, t: setattr(self, "last", t)])
        except ValueError as e:
            # Another worker finished this trial meanwhile (it judged our heartbeat stale
            # and failed it, so a retry of it is queued): our result is dropped, and the
            # worker goes on rather than dying with the study unfinished.
            if "Cannot tell a" not in str(e):
                raise
            return False
        return self.last is not None and measured(self.last)

    def state(self):
        trials = self.study.get_trials(deepcopy=False)
        done = [t for t in trials if measured(t)]
        seen = {_frozen(t.params) for t in done}
        exhausted = all(_frozen(params_of(c)) in seen for c in self.space.choices)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        running = [t for t in trials if t.state == TrialState.RUNNING]
        default = _frozen(params_of(default_choice(self.key)))
        has_default = any(_frozen(t.params) == default for t in done)
        return done, exhausted, waiting, running, has_default

    def run(self, deadline: float | None, hard_deadline: float | None, on_trial=None) -> None:
        reclaim_dead(self.study)
        for i, c in enumerate(seeds(self.space)):
            self.study.enqueue_trial(params_of(c), user_attrs={"seed": "default" if i == 0 else "path"},
                                     skip_if_exists=True)
        idle = 0
        while True:
            done, exhausted, waiting, _, has_default = self.state()
            now = time.time()
            # The default is measured even past this study's share of the time (only the
            # global deadline stops it): without it the entry cannot be judged.
            if hard_deadline is not None and now >= hard_deadline:
                return
            if has_default and deadline is not None and now >= deadline:
                return
            if self.task.trials is not None and len(done) >= self.task.trials:
                break
            if (exhausted and not waiting) or idle >= MAX_IDLE:
                break
            if idle >= 2 and not exhausted and not waiting:
                # the sampler keeps drawing measured candidates (a small space nearly done):
                # hand it one that is not, so a space is exhausted, not given up on
                self._enqueue_missing(done)
            idle = 0 if self._one() else idle + 1
            if on_trial:
                on_trial(self)
        self.drain(hard_deadline)

    def _enqueue_missing(self, done) -> None:
        seen = {_frozen(t.params) for t in done}
        for c in self.space.choices:
            if _frozen(params_of(c)) not in seen:
                self.study.enqueue_trial(params_of(c), user_attrs={"seed": "fill"}, skip_if_exists=True)
                return

    def drain(self, hard_deadline: float | None) -> None:
        """Before leaving: run re-enqueued trials of dead workers, and wait for the running
        trials of others, which either finish or go stale and come back as waiting trials.
        Nothing started is left behind unmeasured while some worker is still here."""
        self.draining = True
        limit = time.time() + self.task.grace + self.task.trial_timeout + self.task.heartbeat * 2
        if hard_deadline is not None:
            limit = min(limit, hard_deadline)
        while time.time() < limit:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optuna.storages.fail_stale_trials(self.study)
            _, _, waiting, running, _ = self.state()
            if waiting:
                self._one()
            elif running:
                time.sleep(min(1.0, self.task.heartbeat))
            else:
                return


def run_task(task: Task, on_trial=None) -> list[str]:
    """A worker: every key of the task in order, sharing studies with any other worker."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = make_storage(task.storage_url, task.heartbeat, task.grace)
    evaluator = Evaluator(task)
    wid = worker_id()
    names = []
    from tqdm import tqdm
    bar = tqdm(total=len(task.keys), desc=task.label, position=task.position, unit="study",
               disable=not task.progress, leave=True, dynamic_ncols=True)
    try:
        for i, key in enumerate(task.keys):
            space = build(key, task.smem_limit)
            run = StudyRun(task, space, storage, evaluator, wid)
            names.append(run.name)
            share = None
            if task.deadline is not None:
                share = time.time() + max(0.0, task.deadline - time.time()) / (len(task.keys) - i)

            def show(r: StudyRun, key=key):
                done = [t for t in r.study.get_trials(deepcopy=False) if measured(t)]
                ok = [t.value for t in done if t.state == TrialState.COMPLETE]
                bar.set_postfix_str(f"{key.label} trials {len(done)} best {min(ok):.1f} us" if ok
                                    else f"{key.label} trials {len(done)}", refresh=True)

            show(run)
            run.run(share, task.deadline, on_trial=lambda r: show(r) or (on_trial and on_trial(r)))
            bar.update(1)
    finally:
        bar.close()
        evaluator.close()
    return names


def _worker_entry(task: Task, visible: str | None) -> None:
    if visible is not None:
        # Before anything touches CUDA in this process: it then sees one GPU, as device 0.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    run_task(task)


def run_workers(task: Task, gpus: list[str] | None) -> None:
    """One worker per GPU in `gpus` (each its own process), or this process when None."""
    if not gpus:
        run_task(task)
        return
    import multiprocessing as mp
    make_storage(task.storage_url, task.heartbeat, task.grace)   # the tables exist before the race
    ctx = mp.get_context("spawn")
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mapping = parent_visible.split(",") if parent_visible else None
    procs = []
    for i, g in enumerate(gpus):
        visible = mapping[int(g)] if mapping and g.isdigit() and int(g) < len(mapping) else g
        t = Task(**{**asdict(task), "keys": task.keys, "position": i, "label": f"gpu {g}"})
        p = ctx.Process(target=_worker_entry, args=(t, visible))
        p.start()
        procs.append((g, p))
    failed = []
    for g, p in procs:
        p.join()
        if p.exitcode != 0:
            failed.append(f"gpu {g}: exit code {p.exitcode}")
    if failed:
        raise RuntimeError("tuning workers failed: " + "; ".join(failed))


# -- results --------------------------------------------------------------------------------
@dataclass
class Result:
    key: TuneKey
    study: str
    trials: int
    failed: int
    default_us: float | None
    best_us: float | None
    choice: object | None           # the winner (the default when nothing beat it)
    attrs: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)   # (spec, reason), for the report
    paths: list = field(default_factory=list)      # the paths among the measured trials
    wgmma: bool = False                            # wgmma tiles among the measured trials

    @property
    def speedup(self) -> float | None:
        if self.default_us and self.best_us:
            return self.default_us / self.best_us
        return None


def result(storage, fp: dict, key: TuneKey, smem_limit: int) -> Result | None:
    space = build(key, smem_limit)
    name = study_name(fp, space)
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None
    trials = [t for t in study.get_trials(deepcopy=False) if measured(t)]
    ok = [t for t in trials if t.state == TrialState.COMPLETE]
    fails = [(t.user_attrs.get("spec", "?"), t.user_attrs.get("fail_reason", "")) for t in trials
             if t.state == TrialState.FAIL]
    dparams = _frozen(params_of(default_choice(key)))
    dtrial = next((t for t in ok if _frozen(t.params) == dparams), None)
    res = Result(key, name, len(trials), len(fails), dtrial.value if dtrial else None, None, None, failures=fails)
    if not ok:
        return res
    best = min(ok, key=lambda t: t.value)
    if dtrial is not None and best.value >= dtrial.value:
        best = dtrial
    res.best_us = best.value
    res.choice = space.lookup(dict(best.params))
    res.paths = sorted({t.params["path"] for t in ok}, key=PATHS[key.op].index)
    res.wgmma = any(getattr(getattr(space.lookup(dict(t.params)), "spec", None), "wgmma", False) for t in ok)
    res.attrs = {k: v for k, v in best.user_attrs.get("result", {}).items() if k in ("us_random", "us_skewed")}
    return res

"""CLI commands of the model runtime (synth, perplexity, model bench). Filled in by the
runtime work; `add_commands` registers them on the main parser."""


def add_commands(sub) -> None:
    return None

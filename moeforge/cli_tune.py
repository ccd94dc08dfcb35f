"""CLI commands of the tuner (tune, generate-and-tune, profile). Filled in by the tuner
work; `add_commands` registers them on the main parser."""


def add_commands(sub) -> None:
    return None

"""Field metadata that makes a config field a `specpair serve` option, or a lab switch.

`specpair/cli/options.py` reads it: `help`, and `flag`, `env`, `cli_default`, `off_flag`,
`off_help`, `secret` as it documents them; `lab` for a switch that only measures."""

# A lab switch is read from the environment, never a flag: SPECPAIR_LAB_ + its field's name
# upper-cased (`busy_poll_ms` → SPECPAIR_LAB_BUSY_POLL_MS). ARCHITECTURE.md, "Lab switches".
LAB_PREFIX = "SPECPAIR_LAB_"


def option(text: str, **cli: object) -> dict[str, object]:
    """Field metadata: a field with help is a `specpair serve` option (specpair.cli.options)."""
    return {"help": text, **cli}


def lab(text: str) -> dict[str, object]:
    """Field metadata: a switch that exists to measure something (benchmarks set it), read from
    its `SPECPAIR_LAB_` variable at the config's edge, not shown in `serve --help`."""
    return {"lab": text}


def lab_variable(name: str) -> str:
    """The environment variable of the lab field `name`."""
    return LAB_PREFIX + name.upper()

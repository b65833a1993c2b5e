"""Field metadata that makes a config field a `specpair serve` option.

`specpair/cli/options.py` reads it: `help`, and `flag`, `env`, `cli_default`, `off_flag`,
`off_help`, `secret` as it documents them."""


def option(text: str, **cli: object) -> dict[str, object]:
    """Field metadata: a field with help is a `specpair serve` option (specpair.cli.options)."""
    return {"help": text, **cli}

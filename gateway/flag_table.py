"""A command's flags as a Markdown table, from its argparse parser: docs/serving.md holds dflash-serve's, and a
test keeps it equal to the parser (python -m gateway.flag_table prints it anew)."""

import argparse


def flag_table(parser: argparse.ArgumentParser) -> str:
    """| flag | default | what it does |, one row per documented option (suppressed ones left out)."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings)
        if action.choices:
            names += " " + "\\|".join(str(choice) for choice in action.choices)
        default = "" if action.default is None or action.default is False else f"`{action.default}`"
        text = " ".join((action.help or "").split()).replace("%%", "%").replace("|", "\\|")
        rows.append(f"| {names} | {default} | {text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from gateway.launcher import build_parser

    print(flag_table(build_parser()))

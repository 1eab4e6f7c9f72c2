"""A command's flags as a Markdown table, from its argparse parser: docs/serving.md holds dflash-serve's, and a
test keeps it equal to the parser (python -m gateway.flag_table prints it anew)."""

import argparse


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.choices:
        names += " " + "\\|".join(str(choice) for choice in action.choices)
    default = "" if action.default is None or action.default is False else f"`{action.default}`"
    text = " ".join((action.help or "").split()).replace("%%", "%").replace("|", "\\|")
    return f"| {names} | {default} | {text} |"


def flag_table(parser: argparse.ArgumentParser) -> str:
    """| flag | default | what it does |, one row per documented option (suppressed ones left out), a bold row
    before each topic's."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for group in parser._action_groups:
        shown = [action for action in group._group_actions if action.option_strings
                 and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)]
        if shown:
            rows.append(f"| **{group.title}** | | |")
            rows.extend(_row(action) for action in shown)
    return "\n".join(rows)


if __name__ == "__main__":
    from gateway.launcher import build_parser

    print(flag_table(build_parser(environ={})))

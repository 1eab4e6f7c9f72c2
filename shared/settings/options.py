"""Settings declared once. A topic is a frozen dataclass whose fields are options (`option(...)`: default, help,
choices, bounds, environment variable); a command is a frozen dataclass of topics (`topic(...)`: which of the
topic's options it offers, under which flag prefix). From one command class come its parser (one help section
per topic), its settings from parsed flags (bounds checked), and the JSON a launcher hands to a child process.
Pure Python: the gateway imports it without torch."""

import argparse
import dataclasses
import json
import math
import os
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

SETTINGS_FLAG = "--settings"  # a process's settings as JSON (flags given beside it win)
SETTINGS_ENV = "DFLASH_SETTINGS"  # the same, as dflash-serve hands them to its children (private to the user)


class SettingsError(ValueError):
    """A setting's value is out of its bounds or contradicts another setting; the message names the flag."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    help: str
    choices: tuple | None = None
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive
    env: str | None = None  # variable giving the default; "{role}" is filled with the topic's env role
    aliases: tuple[str, ...] = ()  # other flags that set it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How a command offers a topic: its flags' prefix, its env role, which options, and its own defaults."""
    prefix: str = ""
    env_role: str = ""
    only: tuple[str, ...] | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def option(default, help: str, **bounds) -> Any:
    """A topic field: its default and how its flag reads (help, choices, minimum/above, env)."""
    return dataclasses.field(default=default, metadata={"option": Option(help=help, **bounds)})


def topic(**layout) -> Any:
    """A command field: one topic, laid out as `Layout(**layout)` says."""
    return dataclasses.field(metadata={"layout": Layout(**layout)})


def _base_type(annotation) -> type:
    if get_origin(annotation) in (Union, types.UnionType):
        return next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation


@dataclasses.dataclass(frozen=True)
class Slot:
    """One flag of a command: the topic attribute and option field it sets."""
    topic_name: str
    field: dataclasses.Field
    layout: Layout

    @property
    def option(self) -> Option:
        return self.field.metadata["option"]

    @property
    def flag(self) -> str:
        return "--" + (self.layout.prefix + self.field.name).replace("_", "-")

    @property
    def names(self) -> str:
        """The flag and its aliases, as errors name them."""
        return "/".join((self.flag, *self.option.aliases))

    @property
    def dest(self) -> str:
        return (self.layout.prefix + self.field.name).replace("-", "_")

    @property
    def kind(self) -> type:
        return _base_type(self.field.type)

    @property
    def env(self) -> str | None:
        env = self.option.env
        if not env or ("{role}" in env and not self.layout.env_role):
            return None
        return env.format(role=self.layout.env_role)

    @property
    def default(self):
        return self.layout.defaults.get(self.field.name, self.field.default)

    def convert(self, value):
        """`value` (text from a flag or the environment, or a JSON value) as the option's type, checked."""
        if value is None:
            return None
        kind = self.kind
        if kind is bool:
            if isinstance(value, str):
                value = value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{self.names} must be {'a number' if kind in (int, float) else kind.__name__}, "
                                f"got {value!r}") from None
        option = self.option
        if option.choices is not None and value not in option.choices:
            raise SettingsError(f"{self.names} must be one of {', '.join(map(str, option.choices))}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise SettingsError(f"{self.names} must be a finite number, got {value}")
        if option.minimum is not None and value < option.minimum:
            raise SettingsError(f"{self.names} must be >= {option.minimum:g}, got {value:g}")
        if option.above is not None and not value > option.above:
            raise SettingsError(f"{self.names} must be above {option.above:g}, got {value:g}")
        return value


def slots(command: type) -> list[Slot]:
    """Every flag of a command, in its topics' order."""
    found = []
    for topic_field in dataclasses.fields(command):
        layout = topic_field.metadata["layout"]
        for field in dataclasses.fields(topic_field.type):
            if layout.only is None or field.name in layout.only:
                found.append(Slot(topic_field.name, field, layout))
    return found


def _help(slot: Slot) -> str:
    text = slot.option.help.replace("%", "%%")
    return f"{text} (env {slot.env})" if slot.env else text


def add_arguments(parser: argparse.ArgumentParser, command: type, environ: Mapping[str, str] | None = None) -> None:
    """One argument group per topic; a default from the environment where the option names a variable."""
    environ = os.environ if environ is None else environ
    topic_classes = {f.name: f.type for f in dataclasses.fields(command)}
    sections: dict[str, argparse._ArgumentGroup] = {}
    for slot in slots(command):
        if slot.topic_name not in sections:
            title = topic_classes[slot.topic_name].TITLE
            sections[slot.topic_name] = parser.add_argument_group(
                title + (f" ({slot.layout.prefix.rstrip('-')})" if slot.layout.prefix else ""))
        section = sections[slot.topic_name]
        default = slot.default
        if slot.env and environ.get(slot.env) not in (None, ""):
            try:
                default = slot.convert(environ[slot.env])
            except SettingsError as exc:
                parser.error(f"${slot.env}: {exc}")
        if slot.kind is bool:
            section.add_argument(slot.flag, *slot.option.aliases, dest=slot.dest, action="store_true",
                                 default=default, help=_help(slot))
        else:
            # argparse reads the text as the option's type (naming the flag when it is not one); bounds are
            # checked after, in build, for values from flags, the environment and handed settings alike
            section.add_argument(slot.flag, *slot.option.aliases, dest=slot.dest, type=slot.kind, default=default,
                                 choices=slot.option.choices, metavar=_metavar(slot), help=_help(slot))


def _metavar(slot: Slot) -> str | None:
    if slot.option.choices is not None:
        return "{" + ",".join(map(str, slot.option.choices)) + "}"
    return None


def from_namespace(command: type, namespace: argparse.Namespace):
    """The command's settings from parsed flags: every topic built, every value checked, then the command's own
    cross-checks (its `check` method, where it has one)."""
    values: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(command)}
    for slot in slots(command):
        values[slot.topic_name][slot.field.name] = getattr(namespace, slot.dest)
    return build(command, values)


def build(command: type, values: Mapping[str, Mapping[str, Any]]):
    """A command's settings from {topic: {option: value}}; options not given take the command's defaults."""
    topics = {}
    for topic_field in dataclasses.fields(command):
        layout = topic_field.metadata["layout"]
        given = dict(values.get(topic_field.name, {}))
        known = {f.name for f in dataclasses.fields(topic_field.type)}
        unknown = set(given) - known
        if unknown:
            raise SettingsError(f"unknown settings for {topic_field.name}: {', '.join(sorted(unknown))}")
        for name, default in layout.defaults.items():
            given.setdefault(name, default)
        topics[topic_field.name] = topic_field.type(**given)
    settings = command(**topics)
    for slot in slots(command):
        slot.convert(getattr(getattr(settings, slot.topic_name), slot.field.name))
    check = getattr(settings, "check", None)
    if check is not None:
        check()
    return settings


def environment_defaults(command: type, environ: Mapping[str, str] | None = None):
    """The settings a command would take with no flags: each option's default, or its environment variable's
    value where one is set (what a launcher starts a child's settings from, so that the variables it does not
    set reach the child as if the child had read them)."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(command)}
    for slot in slots(command):
        text = environ.get(slot.env) if slot.env else None
        values[slot.topic_name][slot.field.name] = slot.convert(text) if text not in (None, "") else slot.default
    return build(command, values)


def overlay(base, settings, command: type, topic_name: str):
    """`base` (a topic) with the options `command` offers of its topic `topic_name` taken from `settings`."""
    names = [slot.field.name for slot in slots(command) if slot.topic_name == topic_name]
    return dataclasses.replace(base, **{name: getattr(settings, name) for name in names})


def to_json(settings) -> str:
    """A command's settings as JSON, for a child process's $DFLASH_SETTINGS or --settings."""
    return json.dumps(dataclasses.asdict(settings), separators=(",", ":"))


def parse_command(command: type, parser: argparse.ArgumentParser, argv) -> tuple[Any, argparse.Namespace]:
    """Parse argv with the command's parser (build_parser, plus any flags of the command's own) into its settings
    and the namespace. Settings as JSON (--settings, or $DFLASH_SETTINGS from the launcher) replace the defaults;
    flags given beside them still win. A bad value exits 2 with the flag named, as argparse does."""
    namespace = parser.parse_args(argv)
    handed_json = namespace.settings or os.environ.get(SETTINGS_ENV)
    if handed_json:
        try:
            handed = build(command, json.loads(handed_json))
        except (SettingsError, ValueError, TypeError) as exc:
            parser.error(f"{SETTINGS_FLAG}: {exc}")
        parser.set_defaults(**{slot.dest: getattr(getattr(handed, slot.topic_name), slot.field.name)
                               for slot in slots(command)})
        namespace = parser.parse_args(argv)
    try:
        return from_namespace(command, namespace), namespace
    except SettingsError as exc:  # one line, no usage: the flags parsed, their values do not fit
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def build_parser(command: type, prog: str, description: str,
                 environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument(SETTINGS_FLAG, help=argparse.SUPPRESS)
    add_arguments(parser, command, environ)
    return parser

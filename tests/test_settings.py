"""Every setting declared once (shared/settings): the parsers built from the declarations, their bounds and
environment variables, the cross-setting rules, and dflash-serve's hand-off of each child's settings (the child's
own parser reads back exactly what the launcher built)."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from draft_worker import server as draft_server
from draft_worker.local_proposer import DraftSampling
from gateway import launcher
from gateway import main as gateway_main
from shared.settings import topics
from shared.settings.commands import DraftCommand, GatewayCommand, ServeCommand, VerifyCommand
from shared.settings.options import SETTINGS_ENV, slots, to_json
from verify_worker import generate_cli
from verify_worker import server as verify_server

ROOT = Path(__file__).resolve().parents[1]
ROLE_PARSE = {"verify": verify_server.parse_args, "draft": draft_server.parse_args, "gateway": gateway_main.parse_args}
COMMANDS = (VerifyCommand, DraftCommand, GatewayCommand, ServeCommand)


@pytest.fixture(autouse=True)
def no_dflash_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DFLASH_")]:
        monkeypatch.delenv(name)


def topic_classes() -> list[type]:
    return [value for value in vars(topics).values() if dataclasses.is_dataclass(value)]


def test_each_setting_is_declared_once_and_no_command_declares_its_own():
    names = [field.name for cls in topic_classes() for field in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "two topics declare a setting of the same name"
    for command in COMMANDS:
        flags = [slot.flag for slot in slots(command)]
        assert len(flags) == len(set(flags)), command
    for path in ("gateway/launcher.py", "gateway/main.py", "verify_worker/server.py", "draft_worker/server.py",
                 "shared/feature_transport.py"):
        assert "add_argument(" not in (ROOT / path).read_text(), f"{path} declares a flag beside the settings"


def test_the_draft_sampling_choices_are_the_proposers():
    assert set(topics.DRAFT_SAMPLING) == {mode.value for mode in DraftSampling}


@pytest.mark.parametrize("argv, flag", [
    (["--max-running", "0"], "--max-running"), (["--block-size", "1"], "--block-size"),
    (["--draft-timeout", "0"], "--draft-timeout"), (["--tp", "0"], "--world-size"),
    (["--dtype", "float8"], "--dtype"), (["--kv-cache-budget-mb", "nan"], "--kv-cache-budget-mb"),
    (["--port", "many"], "--port"),
])
def test_a_value_out_of_bounds_exits_2_naming_the_flag(argv, flag, capsys):
    for parse in (launcher.parse_args, verify_server.parse_args):
        if flag == "--port" and parse is verify_server.parse_args:
            continue
        if parse is verify_server.parse_args and argv[0] == "--tp":
            argv = ["--world-size", "0"]
        with pytest.raises(SystemExit) as stopped:
            parse(argv)
        assert stopped.value.code == 2 and flag in capsys.readouterr().err, (parse, argv)


@pytest.mark.parametrize("argv, words", [
    (["--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
    (["--device", "cuda", "--cuda-graphs", "--tp", "2"], "--cuda-graphs needs --tp 1"),
    (["--batch-invariant"], "--batch-invariant needs --device cuda"),
    (["--draft-placement", "local", "--tp", "2"], "--draft-placement local needs --tp 1"),
    (["--stall-timeout", "20"], "--stall-timeout (20 s) must exceed twice the longest wait"),
])
def test_settings_that_contradict_each_other_exit_2_before_anything_starts(argv, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        launcher.parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(f"dflash-serve: error: {words}") and err.count("\n") == 1


def test_environment_variables_give_defaults_and_flags_win(monkeypatch, capsys):
    monkeypatch.setenv("DFLASH_VERIFY_THREADS", "3")
    monkeypatch.setenv("DFLASH_DRAFT_THREADS", "2")
    monkeypatch.setenv("DFLASH_TP_TIMEOUT", "12.5")
    assert verify_server.parse_args([]).threads.threads == 3
    assert draft_server.parse_args([]).threads.threads == 2
    serve = launcher.parse_args([])
    assert (serve.verify_threads.threads, serve.draft_threads.threads) == (3, 2)
    assert serve.parallel.collective_timeout == 12.5
    assert launcher.parse_args(["--verify-threads", "1"]).verify_threads.threads == 1
    assert generate_cli.parse_args([]).threads == 0  # dflash-generate reads no thread variable
    monkeypatch.setenv("DFLASH_VERIFY_METRICS_PORT", "-4")
    with pytest.raises(SystemExit) as stopped:
        verify_server.parse_args([])
    assert stopped.value.code == 2 and "$DFLASH_VERIFY_METRICS_PORT" in capsys.readouterr().err


def test_the_flag_aliases_and_the_role_defaults():
    serve = launcher.parse_args(["--tp", "2", "--tp-timeout", "9"])
    assert (serve.parallel.world_size, serve.parallel.collective_timeout) == (2, 9.0)
    assert verify_server.parse_args([]).metrics.metrics_port == 9101
    assert draft_server.parse_args([]).metrics.metrics_port == 9102
    help_text = launcher.build_parser(environ={}).format_help()
    for cls in (topics.ModelSettings, topics.EngineSettings, topics.SpeculationSettings, topics.HttpSettings):
        assert cls.TITLE + ":" in help_text  # --help grouped by topic


def exposed(settings, command) -> dict:
    return {slot.flag: getattr(getattr(settings, slot.topic_name), slot.field.name) for slot in slots(command)}


@pytest.mark.parametrize("argv", [
    [],
    ["--tp", "3", "--api-key", "k3y", "--served-model-name", "m", "--max-running", "5", "--max-waiting", "2",
     "--feature-transport", "pair", "--zmq-base-port", "6000", "--metrics-base-port", "9300", "--max-model-len", "512",
     "--block-size", "4", "--draft-threads", "1", "--spec-policy", "always", "--max-body-mb", "2.5"],
    ["--draft-placement", "local", "--draft-sampling", "sparse", "--kv-cache-budget-mb", "64"],
    ["--no-draft", "--port", "8123", "--shutdown-timeout", "3"],
])
def test_each_child_reads_back_the_settings_the_launcher_built(argv, monkeypatch):
    children = launcher.build_children(launcher.parse_args(argv))
    for key, child in children.items():
        command = type(child.settings)
        monkeypatch.setenv(SETTINGS_ENV, to_json(child.settings))
        parsed = ROLE_PARSE[child.role](["--role", child.role])
        assert exposed(parsed, command) == exposed(child.settings, command), key
    verify, gateway = children["verify"].settings, children["gateway"].settings
    assert gateway.http.max_pending == verify.engine.max_running + verify.engine.max_waiting
    assert verify.channels.requests_addr == gateway.channels.requests_addr
    if "--tp" in argv:
        ranks = [children[k].settings.parallel for k in children if k.startswith("verify")]
        assert [p.rank for p in ranks] == [0, 1, 2] and {p.world_size for p in ranks} == {3}
        assert [children[k].settings.metrics.metrics_port for k in ("verify", "verify.1", "verify.2")] == [9300, 0, 0]
        assert children["draft"].settings.metrics.metrics_port == 9301
        assert children["draft"].settings.transport.feature_pair_addr == verify.transport.feature_pair_addr \
            == "127.0.0.1:6004"
        assert verify.parallel.master_port == 6003 and gateway.http.api_key == "k3y"
    if "local" in argv:
        assert "draft" not in children and verify.drafting and verify.speculation.draft_sampling == "sparse"


def test_flags_beside_handed_settings_win_and_bad_handed_settings_exit_2(monkeypatch, capsys):
    handed = launcher.build_children(launcher.parse_args([]))["verify"].settings
    monkeypatch.setenv(SETTINGS_ENV, to_json(handed))
    assert verify_server.parse_args(["--max-running", "3"]).engine.max_running == 3
    assert verify_server.parse_args(["--settings", to_json(handed)]).model.target == handed.model.target
    broken = json.loads(to_json(handed))
    broken["engine"]["max_running"] = -1
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(broken))
    with pytest.raises(SystemExit) as stopped:
        verify_server.parse_args([])
    assert stopped.value.code == 2 and "--max-running must be >= 1" in capsys.readouterr().err
    broken["engine"] = {"max_runing": 3}
    monkeypatch.setenv(SETTINGS_ENV, json.dumps(broken))
    with pytest.raises(SystemExit):
        verify_server.parse_args([])
    assert re.search(r"unknown settings for engine: max_runing", capsys.readouterr().err)


def test_what_dflash_serve_does_not_set_reaches_its_children_from_the_environment(monkeypatch):
    """As when each child read its own variables: the worker's metrics bind address (the image sets
    DFLASH_METRICS_HOST=0.0.0.0), the TP backend and master address, the draft deadline floor's default."""
    monkeypatch.setenv("DFLASH_METRICS_HOST", "0.0.0.0")
    monkeypatch.setenv("DFLASH_TP_BACKEND", "gloo")
    monkeypatch.setenv("DFLASH_TP_MASTER_ADDR", "10.0.0.1")
    children = launcher.build_children(launcher.parse_args(["--tp", "2"]))
    for key in ("verify", "verify.1"):
        verify = children[key].settings
        assert verify.metrics.metrics_host == "0.0.0.0" and verify.parallel.tp_backend == "gloo"
        assert verify.parallel.master_addr == "10.0.0.1" and verify.speculation.draft_deadline_floor == 0.25
    assert children["draft"].settings.metrics.metrics_host == "0.0.0.0"
    assert launcher.parse_args(["--metrics-host", "10.1.1.1"]).metrics.metrics_host == "10.1.1.1"

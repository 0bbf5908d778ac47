"""The `edgehaul` console script (product commands) and `python -m edgehaul_dev` (development
commands): each resolves, answers --help, refuses unknown commands, and dispatches to the module's
own main with the remaining arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from edgehaul import cli
from edgehaul_dev import cli as dev_cli
from edgehaul_dev import localstack


def test_console_script_entry_point_loads_main() -> None:
    (ep,) = entry_points(group="console_scripts", name="edgehaul")
    assert ep.load() is cli.main


def test_help_lists_every_command_and_no_args_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS) and "python -m edgehaul_dev" in out
    assert cli.main([]) == 2
    assert dev_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("stack", "deploy", "demo", "drills", "verify"))


def test_unknown_command_is_refused_with_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert dev_cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_store_check_probes_the_stack_store_and_a_missing_block_is_named(
    stack: localstack.StackState, capsys: pytest.CaptureFixture[str],
) -> None:
    from edgehaul.platform.block_loading import BlockNotFoundError

    assert cli.main(["store"]) == 2 and "edgehaul store check" in capsys.readouterr().err
    assert cli.main(["blocks", "remove"]) == 2 and "edgehaul blocks apply" in capsys.readouterr().err
    env = {"AWS_ACCESS_KEY_ID": stack.identities["admin"].access_key_id,
           "AWS_SECRET_ACCESS_KEY": stack.identities["admin"].secret_access_key}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert cli.main(["store", "check", "--endpoint", stack.s3_endpoint, "--no-record", "--no-lifecycle"]) == 0
    out = capsys.readouterr().out
    assert "put-if-none-match" in out and "content-md5" in out, out
    with pytest.raises(BlockNotFoundError, match="no-such-store"):
        cli.main(["store", "check", "no-such-store", "--no-record"])


def test_a_development_command_on_the_product_cli_says_where_it_lives(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["drills"]) == 2
    assert "python -m edgehaul_dev drills" in capsys.readouterr().err


def test_stack_health_dispatches_to_localstack(stack: localstack.StackState, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "edgehaul_dev", "stack", "health", "--root"]
    live = subprocess.run([*run, stack.root], capture_output=True, text=True, timeout=60)
    assert live.returncode == 0 and json.loads(live.stdout)["prefect"] is True, live.stdout + live.stderr
    nothing = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert nothing.returncode == 1 and json.loads(nothing.stdout)["prefect"] is False


def test_a_commands_own_options_reach_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dev_cli.main(["drills", "--help"])
    assert exc.value.code == 0
    assert "--markdown" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["automations", "--help"])
    assert exc.value.code == 0
    assert "--webhook-url" in capsys.readouterr().out

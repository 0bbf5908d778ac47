"""One configuration story: every environment variable the code reads is a field of a settings object
and a row of the settings table of docs/OPERATIONS.md, and the settings validate with errors that name the variable.

The code side is read from the source (ast), not from a list kept by hand: a new `os.environ.get("X")`
in edgehaul/ or edgehaul_dev/ fails here until X is a settings field and documented.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgehaul import cli
from edgehaul.platform import settings as product
from edgehaul.platform.settings import Settings, SettingsError, TorchrunEnv, env_names, get_settings, load
from edgehaul_dev.settings import DevSettings, dev_settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edgehaul", "edgehaul_dev")
# Functions that read os.environ with a key they were given, not a variable of their own (allowed).
DYNAMIC_READERS = {("edgehaul_dev/localstack.py", "environ")}  # saves and restores what it sets
VAR = re.compile(r"\bEDGEHAUL_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


class _Reads(ast.NodeVisitor):
    """Environment reads of one module: keyed reads (name, line) and reads with a computed key (function)."""

    def __init__(self, tree: ast.Module) -> None:
        self.constants = {
            t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)
        }
        self.keyed: list[tuple[str, int]] = []
        self.dynamic: list[tuple[str, int]] = []
        self.function = "<module>"
        self.visit(tree)

    def _key(self, node: ast.AST | None, line: int) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.keyed.append((node.value, line))
        elif isinstance(node, ast.Name) and node.id in self.constants:
            self.keyed.append((self.constants[node.id], line))
        else:
            self.dynamic.append((self.function, line))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value):
            self._key(node.args[0] if node.args else None, node.lineno)  # os.environ.get(X)
        elif isinstance(f, ast.Attribute) and f.attr == "getenv":
            self._key(node.args[0] if node.args else None, node.lineno)  # os.getenv(X)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            self._key(node.slice, node.lineno)  # os.environ[X]
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(_is_environ(c) for c in node.comparators):
            self._key(node.left, node.lineno)  # X in os.environ
        self.generic_visit(node)


def _code_reads() -> tuple[dict[str, list[str]], list[str], dict[str, list[str]]]:
    """(variable -> where it is read), unexplained reads with a computed key, (EDGEHAUL_* named -> where)."""
    keyed: dict[str, list[str]] = {}
    dynamic: list[str] = []
    named: dict[str, list[str]] = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        reads = _Reads(ast.parse(text))
        for name, line in reads.keyed:
            keyed.setdefault(name, []).append(f"{rel}:{line}")
        dynamic += [f"{rel}:{line} ({fn})" for fn, line in reads.dynamic if (rel, fn) not in DYNAMIC_READERS]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in VAR.findall(node.value):
                    named.setdefault(name, []).append(f"{rel}:{node.lineno}")
    return keyed, dynamic, named


def _readme_rows() -> dict[str, str]:
    """the settings table of docs/OPERATIONS.md: variable -> its "used by" cell."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([A-Z][A-Z0-9_*]*)`\s*\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


CLASSES: dict[str, type[product.EnvSettings]] = {"product": Settings, "torchrun": TorchrunEnv, "development": DevSettings}


def _fields() -> dict[str, str]:
    """Every settings variable -> the kind of settings object it belongs to."""
    return {var: kind for kind, cls in CLASSES.items() for var in env_names(cls).values()}


def test_the_source_scan_finds_reads() -> None:
    """The scanner itself: each form of read is found, computed keys are reported."""
    src = ("import os\nK = 'B'\ndef f(k):\n    os.environ.get('A'); os.getenv(K); os.environ['C']\n"
           "    x = 'D' in os.environ\n    os.environ.get(k)\n    os.environ['E'] = '1'\n")
    reads = _Reads(ast.parse(src))
    assert sorted(n for n, _ in reads.keyed) == ["A", "B", "C", "D"]
    assert reads.dynamic == [("f", 6)]


def test_every_variable_the_code_reads_is_a_setting_and_documented() -> None:
    keyed, dynamic, named = _code_reads()
    fields, rows = _fields(), _readme_rows()
    assert named, "no EDGEHAUL_* name found in the code at all: the scan is broken"
    assert not dynamic, f"os.environ read with a computed key (make it a setting): {dynamic}"
    not_fields = {v: w for v, w in keyed.items() if v not in fields}
    assert not not_fields, f"read directly, not a settings field: {not_fields}"
    undocumented = {v: w for v, w in {**keyed, **named}.items() if v not in rows}
    assert not undocumented, f"not in the settings table of docs/OPERATIONS.md: {undocumented}"
    unknown = {v: w for v, w in named.items() if v not in fields and v not in rows}
    assert not unknown, f"EDGEHAUL_* names that are neither settings nor documented: {unknown}"


def test_the_product_reads_the_environment_only_through_its_settings() -> None:
    keyed, _, _ = _code_reads()
    direct = {v: [w for w in where if w.startswith("edgehaul/") and not w.startswith("edgehaul/platform/settings.py")]
              for v, where in keyed.items()}
    assert not {v: w for v, w in direct.items() if w}, "edgehaul/ must use edgehaul.platform.settings"


def test_every_setting_is_described_and_in_the_table_with_its_kind() -> None:
    rows = _readme_rows()
    for var, kind in _fields().items():
        assert var in rows, f"{var} ({kind}) missing from the settings table of docs/OPERATIONS.md"
        assert rows[var].startswith(kind), f"{var}: docs/OPERATIONS.md says {rows[var]!r}, the code says {kind}"
    for cls in CLASSES.values():
        for name, f in cls.model_fields.items():
            assert f.description and len(f.description) > 15, f"{cls.__name__}.{name} has no description"
    stale = {v: used for v, used in rows.items() if used.split(",")[0] in CLASSES and v not in _fields()}
    assert not stale, f"docs/OPERATIONS.md rows of settings that do not exist: {stale}"


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"EDGEHAUL_GATEWAY_PORT": "99999"}, "EDGEHAUL_GATEWAY_PORT"),
        ({"EDGEHAUL_TASK_RUNNER": "spark"}, "EDGEHAUL_TASK_RUNNER"),
        ({"EDGEHAUL_S3_ENDPOINT": "localhost:8333"}, "EDGEHAUL_S3_ENDPOINT"),
        ({"EDGEHAUL_ALERT_WEBHOOK_URL": "hooks.example.com/x"}, "EDGEHAUL_ALERT_WEBHOOK_URL"),
        ({"EDGEHAUL_DASK_WORKERS": "-1"}, "EDGEHAUL_DASK_WORKERS"),
    ],
)
def test_a_bad_product_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                 variable: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=f"^invalid Settings: {variable}: "):
        get_settings()
    with pytest.raises(SettingsError, match=variable):
        load(Settings, env)


@pytest.mark.parametrize(
    ("env", "variable"),
    [({"EDGEHAUL_S3_PORT": "eighty"}, "EDGEHAUL_S3_PORT"), ({"EDGEHAUL_API_AUTH": "maybe"}, "EDGEHAUL_API_AUTH"),
     ({"EDGEHAUL_PREFECT_PORT": "70000"}, "EDGEHAUL_PREFECT_PORT"),
     ({"EDGEHAUL_DRILL_TRIALS": "0"}, "EDGEHAUL_DRILL_TRIALS")],
)
def test_a_bad_development_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                     variable: str) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=variable):
        dev_settings()


def test_values_parse_and_the_accessor_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEHAUL_TASK_RUNNER", " Dask ")
    monkeypatch.setenv("EDGEHAUL_DASK_WORKERS", "3")
    monkeypatch.setenv("EDGEHAUL_GATEWAY_SECRET", "s3cret")
    monkeypatch.setenv("EDGEHAUL_THREADS", "")  # empty = unset
    s = get_settings()
    assert (s.task_runner, s.dask_workers, s.threads) == ("dask", 3, None)
    assert s.gateway_secret is not None and s.gateway_secret.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)
    assert get_settings() is s  # cached while nothing changes
    monkeypatch.setenv("EDGEHAUL_DASK_WORKERS", "5")
    assert get_settings().dask_workers == 5  # a changed variable is seen at once
    # a mapping alone: the process environment does not leak in
    assert load(Settings, {"EDGEHAUL_THREADS": "2"}).dask_workers is None
    monkeypatch.setenv("EDGEHAUL_API_AUTH", "1")
    monkeypatch.setenv("EDGEHAUL_S3_PORT", "0")
    dev = dev_settings()
    assert dev.api_auth is True and dev.s3_port == 0 and dev.prefect_port == 4200


def test_aws_keys_come_as_a_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(Settings, {"AWS_ACCESS_KEY_ID": "AK"}).aws_credentials() is None
    pair = load(Settings, {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}).aws_credentials()
    assert pair is not None and [p.get_secret_value() for p in pair] == ["AK", "SK"]
    monkeypatch.setenv("EDGEHAUL_S3_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK2")
    from edgehaul.blocks import ObjectStore

    store = ObjectStore.from_env()
    assert store.endpoint_url == "http://127.0.0.1:1"
    assert store.access_key_id is not None and store.access_key_id.get_secret_value() == "AK2"


def test_torchrun_variables_are_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    env = product.torchrun_env()
    assert (env.world_size, env.rank, env.local_rank, env.pet_rdzv_endpoint) == (4, 3, 0, None)
    monkeypatch.setenv("RANK", "-1")
    with pytest.raises(SettingsError, match="RANK"):
        product.torchrun_env()


def test_edgehaul_settings_prints_sources_and_masks_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("EDGEHAUL_THREADS=6\nEDGEHAUL_GATEWAY_PORT=9000\n")
    monkeypatch.setenv("EDGEHAUL_GATEWAY_PORT", "9100")  # the environment wins over .env
    monkeypatch.setenv("EDGEHAUL_GATEWAY_SECRET", "do-not-print-me")
    monkeypatch.delenv("EDGEHAUL_THREADS", raising=False)
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "do-not-print-me" not in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == set(env_names(Settings).values())
    assert rows["EDGEHAUL_THREADS"][1:3] == ["6", ".env"]
    assert rows["EDGEHAUL_GATEWAY_PORT"][1:3] == ["9100", "environment"]
    assert rows["EDGEHAUL_GATEWAY_SECRET"][1:3] == ["********", "environment"]
    assert rows["EDGEHAUL_TASK_RUNNER"][1:3] == ["thread", "default"]
    monkeypatch.setenv("EDGEHAUL_THREADS", "lots")
    assert cli.main(["settings"]) == 2
    assert "EDGEHAUL_THREADS" in capsys.readouterr().err


def test_edgehaul_settings_runs_as_a_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "edgehaul.cli", "settings", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"variable": "EDGEHAUL_TASK_RUNNER"' in proc.stdout


def test_contracts_dir_is_read_when_a_contract_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgehaul.contracts import ContractError, load_contract

    assert load_contract("landsat_patch").kind == "landsat_patch"  # the package's contracts by default
    monkeypatch.setenv("EDGEHAUL_CONTRACTS_DIR", str(tmp_path))  # after import: still followed
    with pytest.raises(ContractError, match=str(tmp_path)):
        load_contract("landsat_patch")

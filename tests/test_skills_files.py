"""Everything a skill tells the assistant to use exists: repository paths, entry points, config keys and configs.

    .venv/bin/pytest tests/test_skills*.py -q

Every repository path a skill names (`template/curry_train/...`, `configs/...`, `benchmarks/...`) exists, and
every `apply_*` entry point it names is defined in the file it belongs to; every dotted config key is a field of
the config contract, and every tool-call or CLI example validates against the config it names (so no skill
recommends a patch the template would refuse).
"""

from __future__ import annotations

import re

import pytest
from curry_train import config as C
from skills_support import (
    CLI_COMMANDS,
    CONFIG_NAMES,
    CONFIG_TOOLS,
    ROOT,
    SYMBOL_FILES,
    all_texts,
    cli_examples,
    config_file,
    defined_configs,
    dotted_keys,
    known_config,
    raw_config,
    repo_paths,
    skill_dirs,
    skill_texts,
    tool_calls,
)


def _named_paths() -> list[str]:
    return sorted({p for text in all_texts().values() for p in repo_paths(text)})


@pytest.mark.parametrize("path", _named_paths())
def test_every_named_repository_path_exists(path):
    users = sorted(w for w, t in all_texts().items() if path in repo_paths(t))
    assert (ROOT / path).exists(), f"{path} is named by {users} but does not exist"


def test_skills_name_the_template_files_of_every_primitive():
    named = set(_named_paths())
    expected = {f"template/curry_train/{f}" for f in SYMBOL_FILES.values()} | {
        "template/curry_train/parallel/zero.py",
        "template/curry_train/validation/whitebox.py",
    }
    assert expected <= named, f"not named by any skill: {sorted(expected - named)}"


@pytest.mark.parametrize("symbol", sorted(SYMBOL_FILES))
def test_named_entry_points_are_defined_in_their_files(symbol):
    path = ROOT / "template/curry_train" / SYMBOL_FILES[symbol]
    assert path.is_file(), f"{path.relative_to(ROOT)} does not exist yet"
    assert re.search(rf"^\s*(def|class)\s+{symbol}\b", path.read_text(encoding="utf-8"), re.MULTILINE), (
        f"{symbol} is not defined in {path.relative_to(ROOT)}"
    )


def test_every_backticked_entry_point_is_a_known_one():
    mentioned = {m for t in all_texts().values() for m in re.findall(r"`((?:apply|build)_[a-z0-9_]+)`", t)}
    assert mentioned <= set(SYMBOL_FILES), f"unknown entry points: {sorted(mentioned - set(SYMBOL_FILES))}"


def test_every_dotted_config_key_is_a_config_field():
    fields = {f"{s}.{f}" for s, sec in C.Config.model_fields.items() for f in sec.annotation.model_fields}
    bad = {f"{w}: {k}" for w, t in all_texts().items() for k in dotted_keys(t) if k not in fields}
    assert not bad, "\n".join(sorted(bad))


def test_every_config_a_skill_uses_exists():
    problems = []
    for d in skill_dirs():
        defined = defined_configs(d)
        for where, text in skill_texts(d).items():
            for c in tool_calls(where, text):
                for arg in ("config", "base", "model"):
                    name = c.kwargs.get(arg)
                    if name is None:
                        continue
                    if not known_config(name, defined):
                        problems.append(f"{c!r}: {arg}={name!r} is not a config in configs/")
                    elif name in CONFIG_NAMES and not config_file(name).is_file():
                        problems.append(f"{c!r}: configs/{name}.yaml does not exist yet")
            for w, cmd in cli_examples(where, text):
                for m in re.findall(r"--config\s+(\S+)", cmd):
                    if not (ROOT / m).is_file():
                        problems.append(f"{w}: `{cmd}`: {m} does not exist")
    assert not problems, "\n".join(problems)


def test_tool_call_examples_validate_against_their_configs():
    """A skill must never show a config patch that the template's validation refuses."""
    problems = []
    for d in skill_dirs():
        defined = defined_configs(d)
        for where, text in skill_texts(d).items():
            for c in tool_calls(where, text):
                if c.error:
                    continue
                try:
                    if c.name in CONFIG_TOOLS and known_config(c.kwargs.get("config"), defined):
                        C.from_dict(raw_config(c.kwargs["config"], defined), c.kwargs.get("overrides") or {})
                    elif c.name == "update_config":
                        C.from_dict(raw_config(c.kwargs["name"], defined))
                except FileNotFoundError:
                    continue  # reported by test_every_config_a_skill_uses_exists
                except C.ConfigError as e:
                    problems.append(f"{c!r}:\n{e}")
    assert not problems, "\n".join(problems)


def test_cli_examples_use_real_commands_and_valid_overrides():
    import shlex

    problems = []
    for where, text in all_texts().items():
        for w, cmd in cli_examples(where, text):
            argv = shlex.split(cmd)
            if len(argv) < 2 or argv[1] not in CLI_COMMANDS:
                problems.append(f"{w}: `{cmd}`: unknown command")
                continue
            sets = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]
            cfgs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
            if not cfgs or not (ROOT / cfgs[0]).is_file():
                continue
            try:
                C.load_config(ROOT / cfgs[0], C.parse_sets(sets))
            except C.ConfigError as e:
                problems.append(f"{w}: `{cmd}`:\n{e}")
    assert not problems, "\n".join(problems)

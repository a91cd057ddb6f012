"""The documentation's commands, run or checked: README.md and docs/*.md.

Every fenced ```bash block carries a marker on the line before its fence (blank lines allowed in between); an
unmarked block fails ``test_every_bash_block_is_marked``:

    <!-- doc-test: run [slow] [id=NAME] [after=NAME] [append="FLAGS"] [to="REGEX"] [parse-only="REGEX"] -->
    <!-- doc-test: parse -->
    <!-- doc-test: ci -->

``run``: the block runs on the tiny models, with ``bash -euo pipefail``, in a workspace of its own: a temporary folder
holding a symlink to every top-level entry of the repository except ``data/`` and ``outputs/``, so the commands'
relative paths work and what they write (``data/...``, ``outputs/...``) lands in the temporary folder. ``python`` is
this interpreter's; the launchers' env vars are unset, ``MASTER_PORT`` is a free port, ``OMP_NUM_THREADS`` 1 unless set.
  - ``slow``: the block is a ``-m slow`` case (the default tier's run blocks take ~80 s together on 2 busy cores);
    ``cover=TEST`` names its default-tier cover and ``cost=SECONDS`` its cost, as the ``slow`` marker's arguments
    (tests/suite_rules.py checks them).
  - ``id=NAME`` names the block; ``after=NAME`` runs this block in NAME's workspace after NAME (which is run first if
    it has not run in this session): commands that read what another block wrote (sampling after a demo). A
    default-tier block cannot come after a slow one.
  - ``append="FLAGS"`` appends FLAGS to every command of the block that matches ``to`` (a regex searched in the
    command; default: a launcher, ``scripts/...sh``), before any trailing comment: it cuts a demo to a few steps.
  - ``parse-only="REGEX"``: commands matching REGEX (searched in the command, not its comment) are checked as in
    ``parse`` instead of run (one of a block's commands needs 10 minutes or a GPU).
  - Install commands (``python3 -m venv .venv``, ``. .venv/bin/activate``, ``pip install -e ...``) joined by ``&&``
    to a command are not run (the test runs in an installed environment); they are checked as in ``ci``.
``parse``: commands that need real weights, GPUs, an NPU or Slurm. Each command (backslash continuations joined,
comments dropped, ``VAR=value`` prefixes and ``$VARS`` set in the block expanded, ``[...]`` optional parts read as
given) is checked: the script or module exists, every ``--flag`` exists in its argparse parser (``python X.py``,
``torchrun ... X.py``, ``python -m fastvideo.X [SUBCOMMAND]``; ``bash scripts/X.sh`` and ``sbatch`` pass flags to the
trainer the launcher runs), every ``VAR=`` prefix of a launcher is a variable the launcher (or what it sources or
runs) reads, and every path into the repository's own folders (``--config scripts/recipes/...``, ``RECIPE=...``)
exists. Every ``run`` block's commands (appended flags included) get the same check in the default tier.
``ci``: CI runs the block itself: ``.ci/run`` (traced with ``VENV`` pointing at a stub python that records its
arguments) must run each ``python -m pytest ...`` command with exactly those arguments (the evidence tier's with
``--evidence-shard K/N`` after them: CI runs one shard); install commands must name
extras setup.py has, and ``.ci/run`` must make a venv and pip install the package with -e.

The links of every page (relative files, ``#anchors`` by GitHub's rules) must resolve, docs/README.md and README.md
must link every page, README.md stays within 150 lines, and docs/config.md's recipe table lists every
``scripts/recipes/*.yaml``.

``python tests/test_docs.py --collect-options TARGETS_JSON`` is this file's helper process: it prints the option
strings of each script's or module's argparse parser (captured at ``--help``), so a parse check imports torch once.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
COMMAND_LANGS = {"bash", "sh", "shell"}
MARKER_RE = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
RUN_KEYS = {"id", "after", "append", "to", "parse-only", "cover", "cost"}
# env vars of a process, not of a launcher: accepted as prefixes of any command
PROCESS_ENV = {"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "WANDB_MODE",
               "MALLOC_MMAP_THRESHOLD_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "HF_HUB_OFFLINE",
               "PYTHONPATH"}
SHELL_OPS = {"&&", "||", ";", "|", "&"}


# ---------------------------------------------------------------------------------------------------- the documents
@dataclass
class Marker:
    mode: str
    slow: bool = False
    opts: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str | None:
        return self.opts.get("id")


@dataclass
class Block:
    file: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: Marker | None
    marker_line: int | None
    problem: str | None = None  # a marker that does not parse

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def parse_marker(text: str) -> Marker:
    words = shlex.split(text)
    if not words or words[0] not in ("run", "parse", "ci"):
        raise ValueError(f"doc-test marker {text.strip()!r}: the mode must be run, parse or ci")
    marker = Marker(words[0])
    for word in words[1:]:
        if word == "slow":
            marker.slow = True
        elif "=" in word and word.split("=", 1)[0] in RUN_KEYS:
            key, value = word.split("=", 1)
            marker.opts[key] = value
        else:
            raise ValueError(f"doc-test marker: unknown word {word!r} (slow, {', '.join(sorted(RUN_KEYS))}=...)")
    if marker.mode != "run" and (marker.slow or marker.opts):
        raise ValueError(f"doc-test marker: {marker.mode} blocks take no options (slow, id=, ... are for run)")
    for key in ("to", "parse-only"):
        if key in marker.opts:
            re.compile(marker.opts[key])
    return marker


def read_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of one page, with their markers; and the problems found on the way (stray markers)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, problems, i = [], [], 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            if MARKER_RE.match(lines[i]):
                j = i + 1
                while j < len(lines) and not lines[j].strip():
                    j += 1
                nxt = FENCE_RE.match(lines[j]) if j < len(lines) else None
                if not nxt or nxt.group(3).lower() not in COMMAND_LANGS:
                    problems.append(f"{path.relative_to(ROOT)}:{i + 1}: a doc-test marker not followed by a ```bash "
                                    "block")
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = MARKER_RE.match(lines[k]) if k >= 0 else None
        block = Block(path, i + 1, lang, code, None, k + 1 if mm else None)
        if mm:
            try:
                block.marker = parse_marker(mm.group(1))
            except ValueError as err:
                block.problem = str(err)
        blocks.append(block)
        i = j + 1
    return blocks, problems


@functools.cache
def all_blocks() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in DOC_FILES:
        b, p = read_blocks(path)
        blocks += b
        problems += p
    return blocks, problems


def command_blocks() -> list[Block]:
    return [b for b in all_blocks()[0] if b.lang in COMMAND_LANGS and b.marker is not None]


def blocks_by_id() -> dict[str, Block]:
    return {b.marker.id: b for b in command_blocks() if b.marker.id}


# -------------------------------------------------------------------------------------------------- shell reading
def logical_lines(code: str) -> list[str]:
    """Backslash continuations joined; blank and comment-only lines dropped."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def strip_comment(line: str) -> tuple[str, str]:
    """(command, ' # comment') split at the first unquoted '#' that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), " " + line[i:]
    return line, ""


def split_and(line: str) -> list[str]:
    """The parts of a command line joined by an unquoted '&&'."""
    parts, quote, start, i = [], None, 0, 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif line.startswith("&&", i):
            parts.append(line[start:i].strip())
            start = i + 2
            i += 1
        i += 1
    parts.append(line[start:].strip())
    return parts


def optional_parts_as_given(line: str) -> str:
    """``[--flag X]`` and ``a|b`` alternatives inside brackets read as plain words (placeholder syntax of the docs)."""
    out, depth, quote = [], 0, None
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
            out.append(ch)
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "[":
            depth += 1
            out.append(" ")
        elif ch == "]" and depth:
            depth -= 1
            out.append(" ")
        elif ch == "|" and depth:
            out.append(" ")
        else:
            out.append(ch)
    return "".join(out)


def expand(line: str, variables: dict[str, str]) -> str:
    def sub(m):
        name = m.group(1) or m.group(2)
        return variables.get(name, m.group(0))
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, line)


def tokenize(line: str) -> list[list[str]]:
    """Commands of one line (split at &&, ||, ;, |), each a token list; comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    commands, current = [], []
    for tok in lex:
        if tok in SHELL_OPS:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(tok)
    if current:
        commands.append(current)
    return commands


ASSIGN_RE = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)


def split_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    env, i = {}, 0
    while i < len(tokens) and ASSIGN_RE.match(tokens[i]):
        name, value = ASSIGN_RE.match(tokens[i]).groups()
        env[name] = value
        i += 1
    return env, tokens[i:]


# ----------------------------------------------------------------------------------------------- what a command needs
@functools.cache
def repo_dirs() -> set[str]:
    """Top-level folders whose paths a doc may name and that must then exist (data/ and outputs/ are made by runs)."""
    return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
            and p.name not in ("data", "outputs") and not p.name.endswith(".egg-info")}


@functools.cache
def script_text(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


@functools.cache
def shell_files(rel: str) -> tuple[str, ...]:
    """A shell script and, recursively, the repo scripts it sources or runs."""
    seen, todo = [], [rel]
    while todo:
        cur = todo.pop()
        if cur in seen or not (ROOT / cur).is_file():
            continue
        seen.append(cur)
        for m in re.finditer(r"(?:^|\s)(?:\.|source|bash)\s+\"?(scripts/[\w./-]+)", script_text(cur), re.M):
            todo.append(m.group(1))
        m = re.search(r"LAUNCHER=\$\{LAUNCHER:-([\w./-]+)\}", script_text(cur))
        if m:
            todo.append(m.group(1))
    return tuple(seen)


def reads_var(rel: str, name: str) -> bool:
    return any(re.search(r"\$\{?" + re.escape(name) + r"\b", script_text(f)) for f in shell_files(rel))


@functools.cache
def launcher_target(rel: str) -> str | None:
    """The Python script a launcher passes its extra flags to."""
    text = "\n".join(ln for ln in script_text(rel).splitlines() if not ln.lstrip().startswith("#"))
    found = [m for m in dict.fromkeys(re.findall(r"\b([\w-]+\.py)\b", text)) if (ROOT / m).is_file()]
    return found[0] if len(found) == 1 else None


@functools.cache
def setup_extras() -> set[str]:
    text = (ROOT / "setup.py").read_text()
    m = re.search(r"extras_require\s*=\s*\{(.*?)\n\s*\}", text, re.S)
    return set(re.findall(r"[\"'](\w+)[\"']\s*:", m.group(1))) if m else set()


@functools.cache
def ci_invocations() -> list[list[str]]:
    """The arguments of every Python call .ci/run makes, traced: .ci/run runs with VENV set to a folder whose
    bin/python only records its arguments (so nothing is installed and no test runs)."""
    import tempfile

    path = ROOT / ".ci" / "run"
    if not path.is_file():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "calls.jsonl"
        stub = Path(tmp) / "venv" / "bin" / "python"
        stub.parent.mkdir(parents=True)
        stub.write_text(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -c 'import json, sys; "
                        f"open(sys.argv[1], \"a\").write(json.dumps(sys.argv[2:]) + chr(10))' {shlex.quote(str(log))} "
                        '"$@"\n')
        stub.chmod(0o755)
        env = {**os.environ, "VENV": str(stub.parent.parent)}
        subprocess.run(["bash", str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def is_install(tokens: list[str]) -> bool:
    if not tokens:
        return False
    prog = os.path.basename(tokens[0])
    return ((prog.startswith("python") and tokens[1:3] == ["-m", "venv"])
            or (prog in (".", "source") and len(tokens) > 1 and tokens[1].endswith("bin/activate"))
            or (prog.startswith("pip") and "install" in tokens[1:2])
            or (prog.startswith("python") and tokens[1:4] == ["-m", "pip", "install"]))


def check_install(tokens: list[str]) -> list[str]:
    """An install command of the docs: the extras it names exist, and CI makes a venv and installs the package -e."""
    problems = []
    prog = os.path.basename(tokens[0])
    if prog.startswith("python") and tokens[1:3] == ["-m", "venv"]:
        if not re.search(r"-m venv\b", (ROOT / ".ci" / "run").read_text()):
            problems.append(".ci/run makes no venv (python -m venv)")
    elif "install" in tokens:
        for tok in tokens[tokens.index("install") + 1:]:
            m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", tok)
            if m and m.group(1):
                problems += [f"setup.py has no extra {e!r} (extras: {sorted(setup_extras())})"
                             for e in m.group(1).split(",") if e not in setup_extras()]
        if not any(c[:3] == ["-m", "pip", "install"] and "-e" in c and any(re.fullmatch(r"\.(\[[\w,]+\])?", a)
                                                                          for a in c) for c in ci_invocations()):
            problems.append(".ci/run does not pip install -e the package")
        if "-c" in tokens:  # the tested versions: the file exists and CI installs with it
            pins = tokens[tokens.index("-c") + 1]
            if not (ROOT / pins).is_file():
                problems.append(f"-c {pins}: no such file")
            if not any(c[:3] == ["-m", "pip", "install"] and c[c.index("-c") + 1:c.index("-c") + 2] == [pins]
                       for c in ci_invocations() if "-c" in c):
                problems.append(f".ci/run does not install with -c {pins}")
    return problems


# target of a flag check: ("script", "train_grpo_flux.py") or ("module", "fastvideo.plot")
Target = tuple[str, str]


def command_target(tokens: list[str], env: dict[str, str]) -> tuple[Target | None, list[str], list[str]]:
    """(parser target, the arguments it parses, problems) of one command; target None when there are no flags to
    check."""
    prog = os.path.basename(tokens[0])
    args = tokens[1:]
    if prog.startswith("python"):
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] != "-m":
            i += 1
        if i < len(args) and args[i] == "-m":
            module = args[i + 1] if i + 1 < len(args) else ""
            if module == "pytest":
                return None, [], []
            if not module.startswith(("fastvideo", "benchmarks")):
                return None, [], [f"python -m {module}: not a module of this repository"]
            return ("module", module), args[i + 2:], []
        if i < len(args) and args[i].endswith(".py"):
            return script_target(args[i], args[i + 1:])
        return None, [], [f"{' '.join(tokens)}: no script or module"]
    if prog == "torchrun":
        for i, tok in enumerate(args):
            if tok.endswith(".py"):
                return script_target(tok, args[i + 1:])
        return None, [], ["torchrun without a .py script"]
    if prog == "bash" and args:
        rel = args[0]
        if not (ROOT / rel).is_file():
            return None, [], [f"{rel}: no such script"]
        problems = [f"{rel} does not read {name} (the launcher's env vars: grep '${{{name}' finds nothing)"
                    for name in env if name not in PROCESS_ENV and not reads_var(rel, name)]
        if rel.startswith(".ci/"):
            return None, [], problems
        target = launcher_target(rel)
        if target is None:
            return None, [], problems + [f"{rel}: cannot tell which Python script it passes flags to"]
        return ("script", target), args[1:], problems
    if prog == "sbatch":
        for i, tok in enumerate(args):
            if tok.endswith(".sbatch"):
                if not (ROOT / tok).is_file():
                    return None, [], [f"{tok}: no such file"]
                problems = [f"{tok} does not read {name}" for name in env
                            if name not in PROCESS_ENV and not reads_var(tok, name)]
                launcher = env.get("LAUNCHER") or re.search(r"LAUNCHER=\$\{LAUNCHER:-([\w./-]+)\}",
                                                            script_text(tok)).group(1)
                target = launcher_target(launcher)
                return ("script", target), args[i + 1:], problems
        return None, [], ["sbatch without a .sbatch file"]
    return None, [], [f"{prog}: no check for this program (python, torchrun, bash scripts/..., sbatch)"]


def script_target(rel: str, args: list[str]) -> tuple[Target | None, list[str], list[str]]:
    if not (ROOT / rel).is_file():
        return None, [], [f"{rel}: no such script"]
    return ("script", rel), args, []


def path_problems(tokens: list[str]) -> list[str]:
    out = []
    for tok in tokens:
        value = tok.split("=", 1)[1] if ASSIGN_RE.match(tok) or (tok.startswith("--") and "=" in tok) else tok
        first = value.split("/", 1)[0]
        if "/" in value and first in repo_dirs() and "..." not in value and not (ROOT / value).exists():
            out.append(f"{value}: no such file in the repository")
    return out


def flag_problems(target: Target, args: list[str], options: dict) -> list[str]:
    entry = options.get(f"{target[0]}:{target[1]}")
    if entry is None or "error" in entry:
        return [f"{target[1]}: could not read its flags ({(entry or {}).get('error', 'not collected')})"]
    known = set(entry["options"])
    words = [a for a in args if not a.startswith("-")]
    if entry.get("subcommands") and words and words[0] in entry["subcommands"]:
        known |= set(entry["subcommands"][words[0]])
    elif entry.get("subcommands") and args:
        return [f"{target[1]}: no subcommand among {sorted(entry['subcommands'])}"]
    out = []
    for a in args:
        if a.startswith("--") and len(a) > 2:
            flag = a.split("=", 1)[0]
            if flag not in known:
                out.append(f"{target[1]} has no flag {flag}")
    return out


@dataclass
class Command:
    line: str  # the logical line it came from (for messages)
    env: dict[str, str]
    tokens: list[str]


def block_commands(block: Block, with_append: bool = True) -> list[Command]:
    """The block's commands as the parse check reads them (variables of the block expanded)."""
    variables: dict[str, str] = {}
    append = block.marker.opts.get("append", "") if with_append and block.marker else ""
    to = re.compile(block.marker.opts.get("to", r"scripts/\S+\.sh")) if block.marker else None
    out = []
    for line in logical_lines(block.code):
        line = optional_parts_as_given(expand(line, variables))
        for tokens in tokenize(line):
            env, rest = split_env(tokens)
            if not rest:
                variables.update(env)
                continue
            if append and to.search(" ".join(tokens)) and not is_install(rest):
                rest = rest + shlex.split(append)
            out.append(Command(line, env, rest))
    return out


# --------------------------------------------------------------------------------------------------- parser options
class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _collect_options(targets: list[list[str]]) -> dict:
    """Helper process: each target's parser, captured when it prints its --help."""
    import runpy

    def capture(self, file=None):
        raise _Captured(self)

    argparse.ArgumentParser.print_help = capture
    out = {}
    for kind, name in targets:
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        try:
            if kind == "script":
                path = ROOT / name
                sys.argv = [str(path), "--help"]
                sys.path.insert(0, str(path.parent))
                runpy.run_path(str(path), run_name="__main__")
            else:
                sys.argv = [name, "--help"]
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            out[f"{kind}:{name}"] = {"error": "--help printed no argparse help"}
        except _Captured as got:
            parser = got.parser
            entry = {"options": sorted({o for a in parser._actions for o in a.option_strings})}
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if subs:
                entry["subcommands"] = {n: sorted({o for a in p._actions for o in a.option_strings})
                                        for n, p in subs[0].choices.items()}
            out[f"{kind}:{name}"] = entry
        except BaseException as err:  # noqa: BLE001 - reported as the target's problem
            out[f"{kind}:{name}"] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    return out


@functools.cache
def parser_options() -> dict:
    """Option strings of every script and module the docs' commands call, from one helper process."""
    targets = set()
    for block in command_blocks():
        if block.marker.mode == "ci":
            continue
        for cmd in block_commands(block):
            if not is_install(cmd.tokens):
                target, _, _ = command_target(cmd.tokens, cmd.env)
                if target:
                    targets.add(target)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--collect-options", json.dumps(sorted(targets))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"collecting the parsers' flags failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_command(cmd: Command) -> list[str]:
    if is_install(cmd.tokens):
        return check_install(cmd.tokens)
    target, args, problems = command_target(cmd.tokens, cmd.env)
    problems = problems + path_problems(list(cmd.tokens) + [f"{k}={v}" for k, v in cmd.env.items()])
    if target:
        problems += flag_problems(target, args, parser_options())
    return problems


def _option(args: list[str], name: str) -> str | None:
    """The value after ``name`` in ``args`` (None when absent)."""
    return args[args.index(name) + 1] if name in args[:-1] else None


def _without_selection(args: list[str]) -> list[str]:
    """A pytest call's arguments without what selects, orders or records tiers (-m, --slow-shard, --evidence-shard,
    --tiers-in-order, --record-durations)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-m", "--evidence-shard", "--slow-shard", "--record-durations"):
            skip = True
        elif a != "--tiers-in-order":
            out.append(a)
    return out


def check_ci_command(cmd: Command) -> list[str]:
    if is_install(cmd.tokens):
        return check_install(cmd.tokens)
    prog = os.path.basename(cmd.tokens[0])
    if prog == "bash" and cmd.tokens[1:2] == [".ci/run"]:
        return [] if (ROOT / ".ci" / "run").is_file() else [".ci/run: no such file"]
    if prog.startswith("python") and cmd.tokens[1:3] == ["-m", "pytest"]:
        want = cmd.tokens[1:]
        # the evidence tier's command runs in CI as one shard of it (tests/suite_rules.py, docs/testing.md), and CI's
        # one session with a slow shard and an evidence shard after the documented arguments
        if any(c == want or (c[:-2] == want and c[-2] == "--evidence-shard")
               or (c[:-4] == want and c[-4] == "--slow-shard" and c[-2] == "--evidence-shard")
               for c in ci_invocations()):
            return []
        # a tier's command (-m slow, -m evidence, none: the default) runs inside CI's one ordered session of every
        # tier (-m "" --tiers-in-order), with the same other arguments
        if any(c[:2] == want[:2] and _without_selection(c[2:]) == _without_selection(want[2:])
               and _option(c[2:], "-m") == "" and "--tiers-in-order" in c for c in ci_invocations()):
            return []
        calls = "; ".join(" ".join(c) for c in ci_invocations() if c[:2] == ["-m", "pytest"]) or "none"
        return [f".ci/run does not run `python {' '.join(want)}` with exactly these arguments (its pytest calls: "
                f"{calls})"]
    return [f"{' '.join(cmd.tokens)}: a ci block holds python -m pytest ..., install commands or bash .ci/run"]


# --------------------------------------------------------------------------------------------------------- running
def free_port() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:  # the preprocessing launcher uses MASTER_PORT + 1
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    return port


def launcher_vars() -> set[str]:
    names = set()
    for path in (ROOT / "scripts").glob("*"):
        if path.is_file():
            names |= set(re.findall(r"\$\{(\w+)", path.read_text(errors="replace")))
    return names


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in launcher_vars() - {"PATH", "HOME", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
                                   "PYTORCH_ALLOC_CONF"}:
        env.pop(name, None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    return env


def make_workspace(path: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ("data", "outputs"):
            continue
        (path / entry.name).symlink_to(entry)
    return path


def run_script(block: Block) -> str:
    """The bash script a run block becomes: parse-only and install commands left out, flags appended."""
    opts = block.marker.opts
    parse_only = re.compile(opts["parse-only"]) if "parse-only" in opts else None
    to = re.compile(opts.get("to", r"scripts/\S+\.sh"))
    append = opts.get("append", "")
    lines = []
    for line in logical_lines(block.code):
        command, comment = strip_comment(line)
        if parse_only and parse_only.search(command):
            lines.append(f": parse-checked, not run: {shlex.quote(command)}")
            continue
        parts = []
        for part in split_and(command):
            toks = tokenize(part)
            if toks and is_install(split_env(toks[0])[1]):
                continue  # checked by test_commands
            if append and to.search(part) and toks and split_env(toks[0])[1]:  # a command, not an assignment
                part = f"{part} {append}"
            parts.append(part)
        if parts:
            lines.append(" && ".join(parts) + comment)
    return "\n".join(lines) + "\n"


_RESULTS: dict[str, tuple[Path, bool, str]] = {}  # block id (or where) -> (workspace, ok, message)
_OUTPUTS: dict[str, str] = {}  # block id (or where) -> its stdout + stderr


def doc_workspace(block_id: str, tmp_factory) -> tuple[Path, str]:
    """The workspace of the run block ``block_id`` and its output, after it ran (once per session): a test that checks
    what a documented command wrote reads it here instead of running the command again."""
    block = blocks_by_id()[block_id]
    workspace, ok, msg = execute(block, tmp_factory)
    assert ok, msg
    return workspace, _OUTPUTS.get(block.marker.id or block.where, "")


def execute(block: Block, tmp_factory) -> tuple[Path, bool, str]:
    key = block.marker.id or block.where
    if key in _RESULTS:
        return _RESULTS[key]
    after = block.marker.opts.get("after")
    if after:
        dep = blocks_by_id()[after]
        workspace, ok, _ = execute(dep, tmp_factory)
        if not ok:
            _RESULTS[key] = (workspace, False, f"{block.where} runs after {after} ({dep.where}), which failed")
            return _RESULTS[key]
    else:
        workspace = make_workspace(tmp_factory.mktemp("doc-" + re.sub(r"\W+", "-", key)))
    script = run_script(block)
    timeout = 3600 if block.marker.slow else 900
    try:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workspace, env=run_env(),
                              capture_output=True, text=True, timeout=timeout)
        ok = proc.returncode == 0
        _OUTPUTS[key] = proc.stdout + "\n" + proc.stderr
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-60:])
        msg = (f"{block.where}: exit {proc.returncode} in {workspace}\n--- script ---\n{script}"
               f"--- output (tail) ---\n{tail}")
    except subprocess.TimeoutExpired:
        ok, msg = False, f"{block.where}: timed out after {timeout} s in {workspace}\n--- script ---\n{script}"
    _RESULTS[key] = (workspace, ok, msg)
    return _RESULTS[key]


# ------------------------------------------------------------------------------------------------------- the links
def github_slug(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines of ``path`` outside fenced blocks."""
    out, in_fence = [], None
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE_RE.match(line)
        if m:
            in_fence = None if in_fence and line.strip().startswith(in_fence) else (in_fence or m.group(2))
            continue
        if not in_fence:
            out.append((no, line))
    return out


@functools.cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            slug = github_slug(h.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for no, line in prose_lines(path):
        line = re.sub(r"`[^`]*`", "", line)
        out += [(no, t) for t in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)]
    return out


def link_problems(path: Path) -> list[str]:
    problems = []
    for no, target in links(path):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{no}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


# ------------------------------------------------------------------------------------------------------- the tests
def _case_id(block: Block, nth: int) -> str:
    """A block's test id: its ``id=`` if it has one, else its page and its place among the page's command blocks
    (``docs/memory.md#2``), which, unlike a line number, survives an edit of the prose around it (the ids key
    tests/durations.json's record)."""
    return block.marker.id or f"{block.where.rsplit(':', 1)[0]}#{nth}"


def _params(run_only: bool) -> list:
    """One case per marked command block (run blocks only: one per run block, slow ones marked slow)."""
    params, seen = [], {}
    for block in command_blocks():
        page = block.where.rsplit(":", 1)[0]
        seen[page] = seen.get(page, 0) + 1
        if block.problem or (run_only and block.marker.mode != "run"):
            continue
        opts = block.marker.opts
        cost = float(opts["cost"]) if "cost" in opts else None
        marks = [pytest.mark.slow(cover=opts.get("cover"), cost_s=cost)] if run_only and block.marker.slow else []
        params.append(pytest.param(block, id=_case_id(block, seen[page]), marks=marks))
    return params


def test_every_bash_block_is_marked():
    """Every ```bash block has a valid marker; ids are unique; after= names a block of the same or a faster tier."""
    blocks, problems = all_blocks()
    problems = list(problems)
    ids: dict[str, str] = {}
    for b in blocks:
        if b.lang not in COMMAND_LANGS:
            continue
        if b.problem:
            problems.append(f"{b.where}: {b.problem}")
        elif b.marker is None:
            problems.append(f"{b.where}: a ```{b.lang} block without a doc-test marker on the line before it "
                            "(<!-- doc-test: run|parse|ci ... -->; see tests/test_docs.py)")
        elif b.marker.id:
            if b.marker.id in ids:
                problems.append(f"{b.where}: id={b.marker.id} is also {ids[b.marker.id]}")
            ids[b.marker.id] = b.where
    by_id = blocks_by_id()
    for b in command_blocks():
        after = b.marker.opts.get("after")
        if after and after not in by_id:
            problems.append(f"{b.where}: after={after}: no block has that id")
        elif after and by_id[after].marker.slow and not b.marker.slow:
            problems.append(f"{b.where}: a default-tier block cannot run after the slow block {after}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", _params(run_only=False))
def test_commands(block: Block):
    """parse and run blocks: scripts, modules, flags, launcher env vars and repository paths exist; ci blocks:
    .ci/run runs them."""
    problems = []
    for cmd in block_commands(block):
        found = check_ci_command(cmd) if block.marker.mode == "ci" else check_command(cmd)
        problems += [f"`{cmd.line}`: {p}" for p in found]
    assert not problems, f"{block.where} ({block.marker.mode}):\n" + "\n".join(problems)


@pytest.mark.parametrize("block", _params(run_only=True))
def test_run(block: Block, tmp_path_factory):
    """The block, run in a workspace of its own (or of the block it comes after)."""
    _, ok, msg = execute(block, tmp_path_factory)
    assert ok, msg


def test_links():
    """Every relative link of README.md and docs/*.md names an existing file, and its #anchor a heading there."""
    problems = [p for path in DOC_FILES for p in link_problems(path)]
    assert not problems, "\n".join(problems)


def test_every_page_is_linked():
    """docs/README.md (the index) and README.md link every page of docs/."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    problems = []
    for index, prefix in ((ROOT / "docs" / "README.md", ""), (ROOT / "README.md", "docs/")):
        if not index.is_file():
            problems.append(f"{index.relative_to(ROOT)}: missing")
            continue
        linked = {t.partition("#")[0] for _, t in links(index)}
        problems += [f"{index.relative_to(ROOT)} does not link {prefix}{p}" for p in sorted(pages)
                     if prefix + p not in linked]
    assert not problems, "\n".join(problems)


def test_readme_length():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_config_md_lists_every_recipe():
    """docs/config.md's recipe table (the ``## Recipes`` section) has one row per ``scripts/recipes/*.yaml``, and each row
    names the trainer the file's first line names: a recipe added without a row, or a row for a missing file, fails."""
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    m = re.search(r"^## Recipes\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "docs/config.md has no '## Recipes' section"
    rows = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    listed: dict[str, str] = {}
    problems = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = re.fullmatch(r"`([\w.-]+\.yaml)`", cells[0])
        if not name:
            continue  # the header and its rule
        if name.group(1) in listed:
            problems.append(f"docs/config.md lists {name.group(1)} twice")
        listed[name.group(1)] = row
    files = {p.name for p in (ROOT / "scripts" / "recipes").glob("*.yaml")}
    problems += [f"scripts/recipes/{n} has no row in docs/config.md's recipe table" for n in sorted(files - set(listed))]
    problems += [f"docs/config.md lists {n}, which is not in scripts/recipes/" for n in sorted(set(listed) - files)]
    for n in sorted(files & set(listed)):
        first = (ROOT / "scripts" / "recipes" / n).read_text(encoding="utf-8").splitlines()[0]
        trainer = re.match(r"#\s*trainer:\s*(\S+)", first)
        if trainer and trainer.group(1) not in listed[n].split("|")[2]:
            problems.append(f"docs/config.md's row for {n} does not name its trainer {trainer.group(1)}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--collect-options"]:
        result = _collect_options(json.loads(sys.argv[2]))
        sys.stdout.flush()
        print(json.dumps(result))
    else:
        sys.exit(f"usage: python {sys.argv[0]} --collect-options TARGETS_JSON (the tests run under pytest)")

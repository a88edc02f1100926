"""A small reader for ./Containerfile: stages and their instructions, enough to
check the manifests and the built image against it."""

from __future__ import annotations

import json
import pathlib
import shlex
from dataclasses import dataclass, field

PATH = pathlib.Path(__file__).resolve().parents[3] / "Containerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]

    def last(self, op: str) -> str:
        found = self.all(op)
        assert found, f"stage {self.name} has no {op}"
        return found[-1]


def stages(path: pathlib.Path = PATH) -> dict[str, Stage]:
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        lines.append(buf + s)
        buf = ""
    out: dict[str, Stage] = {}
    cur = None
    for line in lines:
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(out)}"
            cur = out[name] = Stage(words[0], name)
        elif cur is not None:
            cur.instructions.append((op, args.strip()))
    return out


def exec_form(args: str) -> list[str]:
    v = json.loads(args)
    assert isinstance(v, list), f"not exec form: {args}"
    return v


@dataclass
class Image:
    """What the image a stage builds runs with (instructions of its bases included)."""
    user: tuple[int, int]
    entrypoint: list[str]
    cmd: list[str]
    expose: set[int]
    copies: list[list[str]]


def image(target: str = "runtime", path: pathlib.Path = PATH) -> Image:
    st = stages(path)
    chain = []
    s = st[target]
    while True:
        chain.append(s)
        if s.base not in st:
            break
        s = st[s.base]
    instr = [i for s in reversed(chain) for i in s.instructions]

    def last(op):
        found = [a for o, a in instr if o == op]
        assert found, f"{target} has no {op}"
        return found[-1]

    uid, gid = (int(x) for x in last("USER").split(":"))
    return Image(user=(uid, gid), entrypoint=exec_form(last("ENTRYPOINT")), cmd=exec_form(last("CMD")),
                 expose={int(p.split("/")[0]) for o, a in instr if o == "EXPOSE" for p in a.split()},
                 copies=[shlex.split(a) for o, a in instr if o == "COPY"])

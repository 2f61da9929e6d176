"""Load ``policies/*.yaml`` into a validated ``Policy``, with ``file:line`` errors.

Sections may be spread over files: lists (``backends``, ``tenants``) concatenate,
``tiers`` merge (a tier defined twice is an error), ``gateway`` appears once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path as FsPath
from typing import Any

import yaml

from extproc.policy.reader import Path, PolicyError, Problem, dotted
from extproc.policy.schema import Policy, build_policy


class _Doc:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.lines: dict[Path, str] = {}
        self.problems: list[Problem] = []

    def locate(self, path: Path) -> str:
        # Walk up to the nearest located ancestor: a missing field points at its parent.
        for n in range(len(path), -1, -1):
            where = self.lines.get(tuple(path[:n]))
            if where:
                return where
        return "<policy>"


def _construct(node: yaml.Node, path: Path, where: str, lines: dict[Path, str],
               problems: list[Problem]) -> Any:
    lines[path] = f"{where}:{node.start_mark.line + 1}"
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for knode, vnode in node.value:
            key = yaml.safe_load(yaml.serialize(knode)) if not isinstance(knode, yaml.ScalarNode) else knode.value
            sub = (*path, str(key))
            if str(key) in out:
                # YAML loaders silently keep the last of duplicate keys; the first would vanish unseen.
                problems.append(Problem(f"{where}:{knode.start_mark.line + 1}",
                                        f"{dotted(sub)}: defined twice (first at {lines[sub]})"))
            lines[sub] = f"{where}:{knode.start_mark.line + 1}"
            out[str(key)] = _construct(vnode, sub, where, lines, problems)
            lines[sub] = f"{where}:{knode.start_mark.line + 1}"
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, (*path, i), where, lines, problems) for i, v in enumerate(node.value)]
    # Scalars: let the safe loader resolve types (ints, bools, nulls) exactly as YAML says.
    return yaml.safe_load(yaml.serialize(node))


def _merge_file(doc: _Doc, file: FsPath, text: str) -> bool:
    """Merge one file into ``doc``; False when it is not even valid YAML."""
    name = str(file)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        doc.problems.append(Problem(f"{name}:{line}", f"not valid YAML: {getattr(exc, 'problem', exc)}"))
        return False
    if node is None:
        return True
    if not isinstance(node, yaml.MappingNode):
        doc.problems.append(Problem(f"{name}:{node.start_mark.line + 1}", "expected a mapping of sections"))
        return False
    local: dict[Path, str] = {}
    part = _construct(node, (), name, local, doc.problems)
    for section, value in part.items():
        offset = 0
        if section not in doc.data:
            doc.data[section] = value
        elif isinstance(value, list) and isinstance(doc.data[section], list):
            offset = len(doc.data[section])
            doc.data[section].extend(value)
        elif isinstance(value, dict) and isinstance(doc.data[section], dict) and section != "gateway":
            for k in value:
                if k in doc.data[section]:
                    doc.problems.append(Problem(local[(section, k)], f"{section}.{k}: defined twice"))
            doc.data[section].update(value)
        else:
            doc.problems.append(Problem(local[(section,)], f"{section}: defined in more than one file"))
            continue
        for path, where in local.items():
            if not path or path[0] != section:
                continue
            if offset and len(path) > 1 and isinstance(path[1], int):
                path = (section, path[1] + offset, *path[2:])
            if len(path) == 1 and path in doc.lines:
                continue
            doc.lines[path] = where
    return True


def policy_files(directory: str | FsPath) -> list[FsPath]:
    d = FsPath(directory)
    if d.is_file():
        return [d]
    return sorted([*d.glob("*.yaml"), *d.glob("*.yml")])


def load_texts(files: Iterable[tuple[FsPath, str]]) -> Policy:
    doc = _Doc()
    parsed = [_merge_file(doc, file, text) for file, text in files]
    if not all(parsed):
        # Validating what did parse would only add errors about the sections that did not.
        raise PolicyError(doc.problems)
    try:
        policy = build_policy(doc.data, doc.locate)
    except PolicyError as exc:
        raise PolicyError([*doc.problems, *exc.problems]) from None
    if doc.problems:
        raise PolicyError(doc.problems)
    return policy


def load_policy(directory: str | FsPath) -> Policy:
    files = policy_files(directory)
    if not files:
        raise PolicyError([Problem(str(directory), "no *.yaml policy files found")])
    return load_texts((f, f.read_text(encoding="utf-8")) for f in files)


def fingerprint(directory: str | FsPath) -> tuple[tuple[str, int, int], ...]:
    """Cheap change detection for hot reload: names, sizes and mtimes."""
    out = []
    for f in policy_files(directory):
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(out)

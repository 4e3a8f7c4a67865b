"""Skills over MCP (SEP-2640, `io.modelcontextprotocol/skills`): `skills/list` and `skills/get` as an Extension.

mcp 2.3.0 does not ship the extension (python-sdk PR #3485); this is the spec's shape with the SDK's `Extension`
API, to be swapped for the SDK's own when it lands. Every file of every skill is also a plain resource
`skill://<skill>/<path>`, which any client can read (the SKILL.md of each skill is in `resources/list`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from mcp.server.extension import Extension, MethodBinding, ResourceBinding
from mcp.server.mcpserver.resources import FileResource
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, PaginatedRequestParams, RequestParams

MIME = {".md": "text/markdown", ".py": "text/x-python", ".json": "application/json", ".yaml": "application/yaml"}
TTL_MS = 300_000


def frontmatter(text: str) -> dict[str, Any]:
    """The YAML front matter of a SKILL.md (verbatim keys)."""
    if not text.startswith("---"):
        return {}
    block = text.split("---", 2)[1]
    data = yaml.safe_load(block)
    return data if isinstance(data, dict) else {}


class GetSkillParams(RequestParams):
    uri: str


class SkillsExtension(Extension):
    identifier = "io.modelcontextprotocol/skills"

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def dirs(self) -> list[Path]:
        return sorted(p.parent for p in self.root.glob("*/SKILL.md")) if self.root.is_dir() else []

    def files(self, d: Path) -> list[Path]:
        return sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts)

    def uri(self, d: Path, f: Path) -> str:
        return f"skill://{d.name}/{f.relative_to(d).as_posix()}"

    def skill(self, d: Path) -> dict[str, Any]:
        return {"uri": f"skill://{d.name}/SKILL.md",
                "frontmatter": frontmatter((d / "SKILL.md").read_text(encoding="utf-8")),
                "resources": [{"uri": self.uri(d, f), "digest": "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest(),
                               "size": f.stat().st_size} for f in self.files(d)]}

    def settings(self) -> dict[str, Any]:
        return {}

    def resources(self) -> list[ResourceBinding]:
        out = []
        for d in self.dirs():
            fm = frontmatter((d / "SKILL.md").read_text(encoding="utf-8"))
            for f in self.files(d):
                is_main = f.name == "SKILL.md" and f.parent == d
                out.append(ResourceBinding(FileResource(
                    uri=self.uri(d, f), name=f"{d.name}/{f.relative_to(d).as_posix()}",
                    title=f"Skill: {d.name}" if is_main else None,
                    description=str(fm.get("description", ""))[:1024] if is_main else None,
                    mime_type=MIME.get(f.suffix, "text/plain"), path=f)))
        return out

    def methods(self) -> list[MethodBinding]:
        async def list_skills(ctx: Any, params: PaginatedRequestParams | None) -> dict[str, Any]:
            return {"resultType": "complete", "skills": [self.skill(d) for d in self.dirs()],
                    "ttlMs": TTL_MS, "cacheScope": "public"}

        async def get_skill(ctx: Any, params: GetSkillParams) -> dict[str, Any]:
            for d in self.dirs():
                if params.uri == f"skill://{d.name}/SKILL.md":
                    return {"resultType": "complete", "skill": self.skill(d), "ttlMs": TTL_MS, "cacheScope": "public"}
            names = ", ".join(d.name for d in self.dirs())
            raise MCPError(code=INVALID_PARAMS, message=f"Unknown skill: {params.uri}; known: {names}")

        return [MethodBinding("skills/list", PaginatedRequestParams, list_skills),
                MethodBinding("skills/get", GetSkillParams, get_skill)]

"""Target roles: architecture-independent names of the prunable projections (`"q_proj"` ... `"down_proj"`, plus the
shorthands `"attention"` / `"mlp"`) and their resolution to module paths (or fused slices) through the architecture
table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .architectures import ArchitectureSpec

__all__ = ["ROLES", "SHORTHANDS", "Target", "normalize_targets", "resolve_targets"]


ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHORTHANDS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True)
class Target:
    """One prunable projection of a decoder layer, by role.

    Args:
        role (`str`): architecture-independent name (one of `ROLES`).
        path (`str`): module path relative to the decoder layer.
        part (`int | None`): for a fused q|k|v projection, which third of its output rows (0 = q, 1 = k, 2 = v).
        parts (`int`): number of equal row blocks of the fused module.
    """

    role: str
    path: str
    part: int | None = None
    parts: int = 1

    @property
    def key(self) -> str:
        """Name inside a layer: the module path, with `[role]` for a slice of a fused module."""
        return self.path if self.part is None else f"{self.path}[{self.role}]"

    def rows(self, out_features: int) -> slice:
        if self.part is None:
            return slice(0, out_features)
        size = out_features // self.parts
        return slice(self.part * size, (self.part + 1) * size)


def normalize_targets(targets) -> tuple[str, ...] | None:
    """Validate role names (plus the shorthands `"attention"` / `"mlp"`); returns them expanded, `None` = all."""
    if targets is None:
        return None
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"`targets` must be a non-empty list of role names (or None for all projections), got {targets!r}."
        )
    out: list[str] = []
    for t in targets:
        names = SHORTHANDS.get(t, (t,))
        for n in names:
            if n not in ROLES:
                raise ValueError(
                    f"Unknown target {t!r}. Valid targets: {', '.join(ROLES)}, or the shorthands "
                    f"{', '.join(repr(k) for k in SHORTHANDS)}."
                )
            if n not in out:
                out.append(n)
    return tuple(r for r in ROLES if r in out)


def resolve_targets(spec: ArchitectureSpec, targets, model_type: str = "") -> list[Target]:
    """The modules (or fused slices) that `targets` names on this architecture, in forward order.

    `None` means every prunable projection (whole modules, a fused q|k|v projection as one). The shorthands only
    expand to the roles the architecture has; an explicit role it lacks (e.g. `gate_proj` on OPT) is an error. When
    all three thirds of a fused projection are targeted, the whole module is one target.
    """
    if targets is None:
        return [Target(_path_role(spec, p), p) for p in spec.linear_paths]
    available = spec.role_targets()
    explicit = {t for t in (targets if not isinstance(targets, str) else (targets,)) if t not in SHORTHANDS}
    roles = normalize_targets(targets)
    missing = sorted(r for r in explicit if r not in available)
    if missing:
        arch = f" ({model_type})" if model_type else ""
        raise ValueError(
            f"This architecture{arch} has no {', '.join(missing)}; its projections are: {', '.join(available)}."
        )
    chosen = [available[r] for r in roles if r in available]
    if not chosen:
        raise ValueError(f"None of the targets {list(targets)} exists here; valid: {', '.join(available)}.")
    out: list[Target] = []
    for t in chosen:
        siblings = [c for c in chosen if c.path == t.path]
        if t.part is not None and len(siblings) == t.parts:
            if t.part == 0:
                out.append(Target("qkv", t.path))
            continue
        out.append(t)
    order = {p: k for k, p in enumerate(spec.linear_paths)}
    return sorted(out, key=lambda t: (order[t.path], t.part or 0))


def _path_role(spec: ArchitectureSpec, path: str) -> str:
    for role, t in spec.role_targets().items():
        if t.path == path and t.part is None:
            return role
    return "qkv"

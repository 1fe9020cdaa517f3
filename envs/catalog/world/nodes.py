"""Mutable taxonomy nodes used while a world is assembled, then frozen into :class:`Category`."""

from __future__ import annotations

from dataclasses import dataclass, field

from envs.catalog.world.model import Attribute, AttributeLink, Category

__all__ = ["Node", "freeze", "link"]

_LINKS: dict[tuple[str, bool], AttributeLink] = {}


def link(handle: str, required: bool) -> AttributeLink:
    """An interned :class:`AttributeLink` (there are only two per attribute)."""
    key = (handle, required)
    found = _LINKS.get(key)
    if found is None:
        found = _LINKS[key] = AttributeLink(handle, required)
    return found


@dataclass(slots=True)
class Node:
    """A category under construction."""

    id: str
    name: str
    parent: Node | None
    synonyms: list[str] = field(default_factory=list)
    policy: str = "ok"
    links: dict[str, bool] = field(default_factory=dict)  # handle -> required, insertion ordered
    children: list[Node] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return self.id.count("-") + 1

    def child(self, name: str, synonyms: list[str] | None = None) -> Node:
        """Append a child numbered after the existing ones; it inherits links and policy."""
        node = Node(
            id=f"{self.id}-{len(self.children) + 1}",
            name=name,
            parent=self,
            synonyms=list(synonyms or []),
            policy=self.policy,
            links=dict(self.links),
        )
        self.children.append(node)
        return node

    def walk(self):  # noqa: ANN201 - generator of Node
        """This node and its descendants, depth first, children in order."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))


def freeze(roots: list[Node], attributes: dict[str, Attribute]) -> dict[str, Category]:
    """Turn node trees into ``{id: Category}`` in depth-first order (verticals in given order).

    Raises:
        ValueError: a node links an attribute that ``attributes`` does not define.
    """
    out: dict[str, Category] = {}
    for root in roots:
        for node in root.walk():
            path = []
            cur: Node | None = node
            while cur is not None:
                path.append(cur.name)
                cur = cur.parent
            for handle in node.links:
                if handle not in attributes:
                    raise ValueError(f"category {node.id} links unknown attribute {handle!r}")
            out[node.id] = Category(
                id=node.id,
                name=node.name,
                full_name=" > ".join(reversed(path)),
                parent_id=node.parent.id if node.parent is not None else None,
                depth=node.depth,
                vertical=root.id,
                is_leaf=not node.children,
                children=tuple(c.id for c in node.children),
                attributes=tuple(link(h, r) for h, r in node.links.items()),
                synonyms=tuple(dict.fromkeys(s for s in node.synonyms if s)),
                policy=node.policy,
            )
    return out

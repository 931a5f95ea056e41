"""One verify step's draft tree as a plotly tidy tree.

The root (last committed token) sits on the left and depth grows to the right.
Children are ordered by draft probability, most probable on top, every subtree owns
a contiguous band of rows (so edges never cross), and a parent sits level with its
first child, so the most probable chain reads as one straight line. The accepted path is drawn
strong, the bonus token hangs after the last accepted node as an extra node of its
own style, the drafted alternatives the target turned down at that point are
marked, and the rest of the tree (never reached by the acceptance walk) is faded.

AR steps (no draft) come out as root -> bonus and DFlash chains as a one-branch
tree: the same code draws all three methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import plotly.graph_objects as go

from engine.trace import Step
from viz.tokens import TokenText, shown

ROOT = 0

# kind -> (legend name, marker colour, opacity); the order is the drawing order
NODE_STYLES = {
    "unreached": ("Off the accepted path", "#9aa3ad", 0.35),
    "rejected": ("Rejected at the stop", "#d9534f", 0.9),
    "accepted": ("Accepted draft token", "#2ca02c", 1.0),
    "bonus": ("Bonus (target's token)", "#1f6fd1", 1.0),
    "root": ("Root (last committed)", "#444444", 1.0),
}
# Small trees get every node labelled; big ones only the nodes that tell the story
# plus the most probable others (everything still has a hover box).
LABEL_ALL_UP_TO = 64
EXTRA_LABELS_IN_BIG_TREES = 32


@dataclass(frozen=True)
class TreeLayout:
    graph: nx.DiGraph  # nodes carry the step's data; edges run parent -> child
    positions: dict[int, tuple[int, int]]  # node -> (depth, row), row 0 at the top
    bonus: int  # the bonus node's id (one past the last draft node)
    row_count: int


def tree_graph(step: Step) -> tuple[nx.DiGraph, int]:
    """The step's tree plus its bonus node, with children inserted most probable first."""
    n = step.tree_size
    bonus = n + 1
    accepted = set(step.accepted)
    last_accepted = step.accepted[-1]
    graph = nx.DiGraph()
    graph.add_node(ROOT, kind="root", token=step.root_token, depth=0, target=step.target_tokens[0])
    for node in range(1, n + 1):
        parent = step.tree_parents[node - 1]
        if node in accepted:
            kind = "accepted"
        elif parent == last_accepted:
            kind = "rejected"
        else:
            kind = "unreached"
        graph.add_node(node, kind=kind, token=step.tree_tokens[node - 1], depth=step.tree_depths[node - 1],
                       prob=step.tree_node_probs[node - 1], path_prob=step.tree_path_probs[node - 1],
                       rank=step.tree_ranks[node - 1], target=step.target_tokens[node], parent=parent)
    graph.add_node(bonus, kind="bonus", token=step.bonus_token, depth=graph.nodes[last_accepted]["depth"] + 1,
                   parent=last_accepted)

    # networkx keeps successors in insertion order, which the layout walks: the bonus
    # goes first under its parent so it lines up with the accepted path.
    def order(node: int) -> tuple[int, float]:
        return (0, 0.0) if node == bonus else (1, -graph.nodes[node]["prob"])

    children: dict[int, list[int]] = {}
    for node in range(1, bonus + 1):
        children.setdefault(graph.nodes[node]["parent"], []).append(node)
    for parent, kids in children.items():
        graph.add_edges_from((parent, kid) for kid in sorted(kids, key=order))
    return graph, bonus


def tidy_layout(step: Step) -> TreeLayout:
    """Leaves take consecutive rows in depth-first order; a parent takes its first
    child's row (for the last accepted node that child is the bonus, so the committed
    tokens line up)."""
    graph, bonus = tree_graph(step)
    rows: dict[int, int] = {}
    next_row = 0
    for node in nx.dfs_postorder_nodes(graph, ROOT):
        first_child = next(graph.successors(node), None)
        if first_child is not None:
            rows[node] = rows[first_child]
        else:
            rows[node] = next_row
            # a blank row under the bonus keeps the committed line clear of the alternatives
            next_row += 2 if node == bonus else 1
    positions = {node: (graph.nodes[node]["depth"], rows[node]) for node in graph}
    return TreeLayout(graph=graph, positions=positions, bonus=bonus, row_count=next_row)


def tree_figure(step: Step, token_text: TokenText, label: str = "") -> go.Figure:
    """``label`` names the run (``ddtree@32``) in the title."""
    layout = tidy_layout(step)
    graph = layout.graph
    labelled = _labelled_nodes(graph)
    fig = go.Figure()
    for edge_kind, style in (("faded", dict(color="#c3c9cf", width=1)),
                             ("accepted", dict(color=NODE_STYLES["accepted"][1], width=3)),
                             ("bonus", dict(color=NODE_STYLES["bonus"][1], width=2, dash="dot"))):
        x, y = _edge_paths(layout, edge_kind)
        if x:
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line=style, hoverinfo="skip", showlegend=False,
                                     name=f"{edge_kind} edges"))
    marker_size = 14 if graph.number_of_nodes() <= LABEL_ALL_UP_TO else 8
    for kind, (legend, colour, opacity) in NODE_STYLES.items():
        nodes = [node for node in graph if graph.nodes[node]["kind"] == kind]
        if not nodes:
            continue
        fig.add_trace(go.Scatter(
            x=[layout.positions[node][0] for node in nodes],
            y=[layout.positions[node][1] for node in nodes],
            mode="markers+text",
            name=legend,
            marker=dict(size=marker_size, color=colour, opacity=opacity, line=dict(width=1, color="white"),
                        symbol="diamond" if kind == "bonus" else "circle"),
            text=[shown(token_text, graph.nodes[node]["token"]) if node in labelled else "" for node in nodes],
            textposition="top center",
            textfont=dict(size=11, color="#222" if kind != "unreached" else "#888"),
            customdata=nodes,
            hovertext=[node_hover(graph, node, layout.bonus, token_text) for node in nodes],
            hoverinfo="text",
        ))
    max_depth = max(position[0] for position in layout.positions.values())
    fig.update_layout(
        title=dict(text=" · ".join(filter(None, [label, tree_title(step)])), x=0, font=dict(size=14)),
        template="plotly_white",
        height=tree_height(layout.row_count),
        margin=dict(l=10, r=10, t=70, b=40),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0, font=dict(size=11)),
        hoverlabel=dict(align="left", bgcolor="white", font=dict(color="#222")),
        xaxis=dict(tickvals=list(range(max_depth + 1)),
                   ticktext=["root"] + [str(d) for d in range(1, max_depth + 1)],
                   title="draft depth", range=[-0.5, max_depth + 0.6], showgrid=False, zeroline=False),
        # rows count down the page; the extra room on top keeps the first label clear of the legend
        yaxis=dict(visible=False, range=[layout.row_count - 0.4, -1.6]),
    )
    return fig


def tree_title(step: Step) -> str:
    drafted = len(step.accepted) - 1
    if step.tree_size == 0:
        return f"Step {step.number}: no draft, the target adds one token"
    return f"Step {step.number}: {step.tree_size} drafted, {drafted} accepted + bonus"


def tree_height(rows: int) -> int:
    """Pixels for ``rows`` rows: the first 16 get 34 px each, the next 48 get 22 and
    the rest 14, so small trees are roomy and big ones still grow row by row."""
    pixels = 34 * min(rows, 16) + 22 * min(max(rows - 16, 0), 48) + 14 * max(rows - 64, 0)
    return min(8000, max(260, 140 + pixels))


def node_hover(graph: nx.DiGraph, node: int, bonus: int, token_text: TokenText) -> str:
    data = graph.nodes[node]
    token = f"<b>{shown(token_text, data['token'])}</b> (id {data['token']})"
    if node == ROOT:
        return (f"root: {token}<br>the last committed token<br>"
                f"target chose next: {shown(token_text, data['target'])}")
    if node == bonus:
        after = "the root" if data["parent"] == ROOT else f"node {data['parent']}"
        return f"bonus: {token}<br>the target's token after {after}, which no drafted child matched"
    return (f"{token}<br>node {node} · depth {data['depth']} · {NODE_STYLES[data['kind']][0].lower()}<br>"
            f"draft prob {data['prob']:.4f}<br>path prob {data['path_prob']:.4g}<br>"
            f"rank at depth: {data['rank'] + 1}<br>"
            f"target chose here: {shown(token_text, data['target'])}")


def _labelled_nodes(graph: nx.DiGraph) -> set[int]:
    if graph.number_of_nodes() <= LABEL_ALL_UP_TO:
        return set(graph)
    story = {node for node in graph if graph.nodes[node]["kind"] in ("root", "accepted", "bonus", "rejected")}
    others = sorted((node for node in graph if node not in story), key=lambda node: -graph.nodes[node]["path_prob"])
    return story | set(others[:EXTRA_LABELS_IN_BIG_TREES])


def _edge_kind(graph: nx.DiGraph, child: int) -> str:
    kind = graph.nodes[child]["kind"]
    return kind if kind in ("accepted", "bonus") else "faded"


def _edge_paths(layout: TreeLayout, edge_kind: str) -> tuple[list, list]:
    """Elbow connectors (out from the parent, down the gap, into the child) for one
    edge kind, as a single polyline broken by ``None`` so plotly draws one trace."""
    xs: list = []
    ys: list = []
    for parent, child in layout.graph.edges:
        if _edge_kind(layout.graph, child) != edge_kind:
            continue
        (px, py), (cx, cy) = layout.positions[parent], layout.positions[child]
        elbow = (px + cx) / 2
        xs += [px, elbow, elbow, cx, None]
        ys += [py, py, cy, cy, None]
    return xs, ys

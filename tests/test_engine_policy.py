"""The engine patch's own logic, without SGLang: type ranking, victim order, admission order,
hint epochs, residency counters, CacheSage survival scores and the offload / load-back plans."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_patches import anchor_scores
from engine_patches.anchor_scores import AnchorScores
from engine_patches.control import ControlPath
from engine_patches.hint_book import HintBatch, HintBook, HintError
from engine_patches.ranking import CacheTier, admit_rank, busy_first, keep_rank, victim_key
from engine_patches.residency import MAX_NODE_PROGRAMS, ResidencyLedger
from engine_patches.tree_plan import NodeView, load_back_plan, offload_plan
from router.policy.types import Hint

B, D, X = Hint.BUSY, Hint.IDLE, Hint.INACTIVE


def evict_order(tier: CacheTier, nodes: dict[str, tuple[list[Hint], float]]) -> list[str]:
    return sorted(nodes, key=lambda n: victim_key(tier, *nodes[n]))


def test_device_evicts_inactive_then_idle_then_busy_lru_within():
    nodes = {
        "busy_old": ([B], 1.0),
        "idle_new": ([D], 9.0),
        "idle_old": ([D], 2.0),
        "inact": ([X], 8.0),
    }
    assert evict_order(CacheTier.DEVICE, nodes) == ["inact", "idle_old", "idle_new", "busy_old"]


def test_host_evicts_inactive_then_idle_then_busy_lru_within():
    # a host victim is a host-only node, its program's only copy: a busy program's is kept
    # longest (its busy hint is loading it back), unlike the paper's inactive-busy-idle
    nodes = {
        "busy": ([B], 0.5),
        "idle_new": ([D], 7.0),
        "idle_old": ([D], 1.0),
        "inact": ([X], 9.0),
    }
    assert evict_order(CacheTier.HOST, nodes) == ["inact", "idle_old", "idle_new", "busy"]


def test_shared_node_takes_most_protective_type_per_tier():
    assert keep_rank(CacheTier.DEVICE, [X, D, B]) == keep_rank(CacheTier.DEVICE, [B])
    assert keep_rank(CacheTier.HOST, [D, X]) == keep_rank(CacheTier.HOST, [D])
    assert keep_rank(CacheTier.HOST, [D, B]) == keep_rank(CacheTier.HOST, [B])
    assert keep_rank(CacheTier.DEVICE, [X, D]) > keep_rank(CacheTier.DEVICE, [X])


def test_unhinted_node_counts_as_busy():
    assert keep_rank(CacheTier.DEVICE, []) == keep_rank(CacheTier.DEVICE, [B])
    assert admit_rank(None) == admit_rank(B)


@given(st.lists(st.tuples(st.sampled_from([B, D, X, None]), st.integers()), max_size=30))
def test_busy_first_is_a_stable_partition(queue):
    before = list(queue)
    busy_first(queue, lambda item: item[0])
    assert sorted(queue, key=lambda item: admit_rank(item[0])) == queue
    for rank in (0, 1, 2):  # the engine's own order survives inside each type
        assert [q for q in queue if admit_rank(q[0]) == rank] == [
            q for q in before if admit_rank(q[0]) == rank
        ]


def test_hint_batch_parse_rejects_bad_bodies():
    assert HintBatch.parse({"epoch": 3, "hints": {"p": "idle"}}).hints == {"p": D}
    for bad in (
        [],
        {"hints": {}},
        {"epoch": -1, "hints": {}},
        {"epoch": True, "hints": {}},
        {"epoch": 1, "hints": []},
        {"epoch": 1, "hints": {"p": "hot"}},
        {"epoch": 1, "hints": {"": "busy"}},
        {"epoch": 1, "hints": {}, "full": "yes"},
    ):
        with pytest.raises(HintError):
            HintBatch.parse(bad)


def test_hint_book_epochs_idempotence_and_full_sync():
    book = HintBook()
    first = book.apply(HintBatch(5, {"a": B, "b": D}))
    assert not first.stale and first.changed == {"a": B, "b": D}
    assert book.apply(HintBatch(5, {"a": B, "b": D})).changed == {}  # re-sent: no-op
    stale = book.apply(HintBatch(4, {"a": X}))
    assert stale.stale and book.hint("a") is B
    full = book.apply(HintBatch(6, {"b": B}, full=True), known=["c"])
    assert full.changed == {"a": X, "b": B, "c": X}
    assert book.hint("zzz") is None and book.hint(None) is None


def test_ledger_counts_per_program_and_shared_prefix():
    led = ResidencyLedger()
    led.observe("root_child", 10, 0)
    led.stamp("root_child", "p1")
    led.stamp("root_child", "p2")
    led.stamp("leaf1", "p1")
    led.observe("leaf1", 5, 0)
    led.observe("leaf1", 5, 5)  # backed up
    led.observe("root_child", 0, 10)  # demoted
    assert led.residency("p1").as_json() == {"device_tokens": 5, "host_tokens": 15}
    assert led.residency("p2").as_json() == {"device_tokens": 0, "host_tokens": 10}
    assert (led.device_used, led.host_used) == (5, 15)
    assert not led.stamp("leaf1", "p1")
    led.forget("leaf1")
    assert led.residency("p1").as_json() == {"device_tokens": 0, "host_tokens": 10}
    led.forget("root_child")
    assert list(led.programs()) == [] and (led.device_used, led.host_used) == (0, 0)


def test_ledger_split_copies_programs():
    led = ResidencyLedger()
    led.stamp("child", "p")
    led.observe("child", 8, 0)
    led.copy_programs("child", "new_parent")
    led.observe("child", 5, 0)
    led.observe("new_parent", 3, 0)
    assert led.residency("p").device_tokens == 8
    assert led.nodes_of("p") == {"child", "new_parent"}


@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.integers(0, MAX_NODE_PROGRAMS + 3),
            st.integers(0, 9),
            st.integers(0, 9),
            st.booleans(),
        ),
        max_size=120,
    )
)
def test_ledger_matches_a_full_recount(ops):
    """Counters after any sequence of updates equal a from-scratch walk, each node counting
    for its MAX_NODE_PROGRAMS most recent users."""
    led = ResidencyLedger()
    truth: dict[int, tuple[list[str], int, int]] = {}
    for node, prog_no, dev, host, drop in ops:
        prog = f"p{prog_no}"
        if drop:
            led.forget(node)
            truth.pop(node, None)
            continue
        led.stamp(node, prog)
        led.observe(node, dev, host)
        users = [u for u in truth.get(node, ([], 0, 0))[0] if u != prog] + [prog]
        truth[node] = (users[-MAX_NODE_PROGRAMS:], dev, host)
    for prog in (f"p{i}" for i in range(MAX_NODE_PROGRAMS + 4)):
        dev = sum(d for us, d, _ in truth.values() if prog in us)
        host = sum(h for us, _, h in truth.values() if prog in us)
        assert led.residency(prog).as_json() == {"device_tokens": dev, "host_tokens": host}
        assert led.holds(prog) == any(prog in us for us, _, _ in truth.values())
    assert led.device_used == sum(d for _, d, _ in truth.values())
    assert led.size()["widest_node"] <= MAX_NODE_PROGRAMS


def test_a_shared_node_keeps_its_most_recent_users_only():
    led = ResidencyLedger()
    led.observe("system_prompt", 100, 100)
    for i in range(1000):  # a thousand programs share one system prompt
        led.stamp("system_prompt", f"p{i}")
    led.stamp("system_prompt", "p990")  # a returning user moves to the back
    led.stamp("system_prompt", "late")
    kept = led.programs_of("system_prompt")
    assert len(kept) == MAX_NODE_PROGRAMS and {"p990", "late", "p999"} <= kept
    assert "p984" not in kept  # the oldest of the last 16 was pushed out by "late"
    assert led.residency("p0").device_tokens == 0 and not led.holds("p0")
    assert led.residency("late").as_json() == {"device_tokens": 100, "host_tokens": 100}
    assert (led.device_used, led.host_used) == (100, 100)
    assert led.size() == {"nodes": 1, "programs": MAX_NODE_PROGRAMS, "widest_node": 16}


def test_kv_hints_program_type_actions_are_read_and_respect_epochs():
    from types import SimpleNamespace as NS

    from engine_patches.kv_actions import program_types

    def action(kind, version="1", **payload):
        return NS(action_id="a", action_type=kind, action_version=version, payload=payload)

    envelope = NS(actions=[
        action("mori.program_type", program="p", type="idle", epoch=7),
        action("mori.program_type", version="2", program="p", type="busy", epoch=9),
        action("sglang.retain", program="p"),
        action("mori.program_type", program="q", type="hot", epoch=7),
        action("mori.program_type", program="q", type="busy", epoch=True),
    ])  # fmt: skip
    (only,) = program_types(envelope)
    assert (only.program, only.hint, only.epoch) == ("p", D, 7)
    assert list(program_types(None)) == []
    book = HintBook()
    book.apply(HintBatch(8, {"p": B}))
    assert not book.request_type("p", D, 7)  # older than the last batch: ignored
    assert book.request_type("p", D, 8) and book.hint("p") is D
    assert not book.request_type("p", D, 9)  # no change


def test_hint_book_forgets_ended_programs_that_hold_nothing():
    book = HintBook()
    book.apply(HintBatch(1, {f"p{i}": X for i in range(1000)} | {"held": X, "live": B}))
    assert len(book.forget_ended(holds=lambda p: p == "held")) == 1000
    assert set(book.types) == {"held", "live"} and book.hint("p3") is None


def test_anchor_scores_parse_rejects_bad_fields():
    for body in (
        {"scores": {"A": 1.5}},
        {"scores": {"A": True}},
        {"scores": ["A"]},
        {"agents": {"p": 3}},
        {"agents": {"": "A"}},
    ):
        with pytest.raises(HintError):
            anchor_scores.parse(body)
    assert anchor_scores.parse({}) == (None, {})
    assert anchor_scores.parse({"scores": {"A": 1}}) == ({"A": 1.0}, {})


def test_survival_is_the_best_role_score_of_a_shared_node_only():
    book = AnchorScores()
    assert book.survival(["a1", "a2"]) == 0.0  # no scores yet: plain typed LRU
    book.apply({"A": 0.9, "B": 0.1}, {"a1": "A", "a2": "A", "b1": "B"})
    assert book.survival(["a1", "a2"]) == 0.9
    assert book.survival(["a1", "b1"]) == 0.9  # the best of its programs' roles
    assert book.survival(["b1", "unnamed"]) == 0.1
    assert book.survival(["a1"]) == 0.0  # private KV keeps the typed LRU order
    book.apply(None, {})  # no `scores` field: the scores stay
    assert book.survival(["a1", "a2"]) == 0.9
    book.apply({}, {})  # empty scores clear them
    assert book.survival(["a1", "a2"]) == 0.0


def test_anchor_scores_forget_ended_programs_and_stay_bounded(monkeypatch):
    book = AnchorScores()
    book.apply({"A": 1.0}, {"a1": "A", "a2": "A", "a3": "A"})
    book.forget(["a1", "never-named"])
    assert list(book.agents) == ["a2", "a3"] and book.survival(["a1", "x"]) == 0.0
    monkeypatch.setattr(anchor_scores, "MAX_AGENTS", 2)
    book.apply(None, {"a2": "A", "a4": "A"})  # a2 named again: a3 is the least recent
    assert list(book.agents) == ["a2", "a4"]


def test_control_path_reports_a_failure_on_any_rank_and_refuses_more_hints():
    peer = {"ok": True}  # the other TP rank's outcome, as the all-reduce reports it
    path = ControlPath(agree=lambda ok: ok and peer["ok"])

    def ok(op, body):
        return {"epoch": 1}

    def bad_input(op, body):
        raise HintError("'epoch' must be a non-negative integer")

    def broken(op, body):
        raise RuntimeError("device error half-way through an offload")

    assert path.run("hints", {}, ok) == {"epoch": 1}
    assert path.run("hints", {}, bad_input)["status"] == 400
    assert path.diverged is None  # a rejected batch changed nothing, on any rank
    peer["ok"] = False  # this rank applied the batch, the other failed half-way
    failed = path.run("hints", {}, ok)
    assert failed["status"] == 500 and "tensor-parallel rank" in failed["error"]
    peer["ok"] = True
    assert path.run("hints", {}, ok)["status"] == 503  # no more hints: restart the replica
    assert path.run("residency", {}, ok) == {"epoch": 1}  # reads still work

    alone = ControlPath()  # tp = 1: the failing rank reports its own error
    answer = alone.run("hints", {}, broken)
    assert answer["status"] == 500 and "device error" in answer["error"]
    assert alone.diverged is not None


def view(nid, depth, progs, dev=True, bak=True, locked=False, children=(), cdev=None):
    return NodeView(
        nid,
        depth,
        frozenset(progs),
        dev,
        bak,
        locked,
        tuple(children),
        tuple(children if cdev is None else cdev),
    )


def test_offload_plan_children_first_skips_shared_locked_unbacked():
    views = [
        view("shared", 1, {"p", "q"}, children=["own"]),
        view("own", 2, {"p"}, children=["leaf_a", "leaf_b"]),
        view("leaf_a", 3, {"p"}),
        view("leaf_b", 3, {"p"}),
        view("other", 1, {"p"}, children=["locked"]),
        view("locked", 2, {"p"}, locked=True),
        view("unbacked", 1, {"p"}, bak=False),
    ]
    plan = offload_plan("p", random.sample(views, len(views)))
    assert set(plan) == {"own", "leaf_a", "leaf_b"}
    assert plan.index("own") > plan.index("leaf_a") and plan.index("own") > plan.index("leaf_b")


def test_offload_plan_ignores_already_evicted():
    views = [view("a", 1, {"p"}, children=["b"], cdev=[]), view("b", 2, {"p"}, dev=False)]
    assert offload_plan("p", views) == ["a"]


def test_load_back_plan_picks_deepest_host_nodes():
    views = [
        view("dev", 1, {"p"}, children=["h1"], cdev=[]),
        view("h1", 2, {"p"}, dev=False, children=["h2", "h3"], cdev=[]),
        view("h2", 3, {"p"}, dev=False),
        view("h3", 3, {"p", "q"}, dev=False),
        view("lost", 3, {"p"}, dev=False, bak=False),
        view("qonly", 2, {"q"}, dev=False),
    ]
    assert sorted(load_back_plan("p", views)) == ["h2", "h3"]


def test_launcher_adds_mori_flags_and_passes_the_rest_through():
    from engine_patches.launch import build_argv

    argv = build_argv(["--model-path", "m", "--port", "9", "--hicache-ratio", "2"])
    assert argv[:6] == ["--model-path", "m", "--port", "9", "--hicache-ratio", "2"]
    assert "--enable-hierarchical-cache" in argv
    assert argv[argv.index("--hicache-write-policy") + 1] == "write_through"
    assert argv[argv.index("--radix-eviction-policy") + 1] == "mori"
    same = ["--radix-eviction-policy=mori", "--enable-hierarchical-cache"]
    assert build_argv(same).count("--enable-hierarchical-cache") == 1


def test_launcher_rejects_flags_that_break_mori(capsys):
    from engine_patches.launch import LaunchError, build_argv, main

    for bad in (
        ["--hicache-write-policy", "write_back"],
        ["--radix-eviction-policy=lru"],
        ["--enable-session-radix-cache"],
    ):
        with pytest.raises(LaunchError):
            build_argv(bad)
    assert main(["--radix-eviction-policy", "lru"]) == 2  # one clear line, no traceback
    assert capsys.readouterr().err.startswith("mori-sglang: error: ")


def test_launcher_keeps_plugin_whitelist_working():
    from engine_patches.launch import plugin_env

    assert plugin_env({}) == {}
    assert plugin_env({"SGLANG_PLUGINS": "other"}) == {"SGLANG_PLUGINS": "other,mori"}
    assert plugin_env({"SGLANG_PLUGINS": "mori"}) == {}

"""scripts/bench/scale.py: the scale harness at a tiny size (16 simulated ranks on two nodes, rank
0's process and one more), its figures positive and consistent with each other, whatever the
protocol its adapter drives; its collective fake's byte counts against torch's ``*_object``
collectives; and the turns that bound how many rank threads of a process run at once."""

from __future__ import annotations

import pickle
import threading

from scripts.bench import scale, scale_clients, scale_report


def test_a_tiny_case_measures_every_figure_consistently() -> None:
    case = scale.Case(16, ranks_per_node=8, items=10, saves=2, warmup=0, workers=1,
                      idle_s=0.3, idle_warmup_s=0.2, idle_nodes=2, budget_s=60.0)
    row = scale.run_case(case)
    assert row["not_measured"] is None, row["not_measured"]
    assert len(row["saves"]) == 2
    for save in row["saves"]:
        requests = save["requests"]
        assert sum(requests.values()) > 0 and requests.get("set", 0) > 0  # the ranks reported
        assert save["bytes"] > 0 and save["rank0_s"] > 0 and save["server_cpu_s"] >= 0
        reads = save["max_read"]
        assert set(reads) == {"rank0", "leader", "other"} and min(reads.values()) >= 0
        # no rank reads more than went through the store, and someone reads (rank 0 the reports)
        assert 0 < max(reads.values()) < save["bytes"]
        assert 0 < save["coll_bytes"] <= 15 * 16384  # the save agreement: at most 16 KiB per peer
    assert 0 <= row["max_read_other"] <= row["max_read_any"] < row["store_bytes"]
    assert row["store_requests"] > 0 and row["rank0_commit_s"] > 0 and row["arrivals_s"] >= 0
    assert row["idle"]["requests_per_s"] >= 0 and row["idle"]["sampled_nodes"] == 2
    restore = row["restore"]
    assert restore["coll_bytes_max"] > 0 and restore["store_bytes"] >= 0
    lines = scale_report.table_rows([row])
    assert len(lines) == 1 and len(lines[0]) == len(scale_report.HEADER) and lines[0][0] == "16"


def test_node_local_roots_whose_members_poll_for_their_copy_outnumbering_the_turns_finish() -> None:
    # three nodes in one client process: 21 ranks poll the store for their node's copy (more
    # than the process's turns) while their leaders need a turn to publish it
    case = scale.Case(24, ranks_per_node=8, items=10, saves=1, warmup=0, workers=1, idle_s=0.1,
                      idle_warmup_s=0.1, idle_nodes=1, budget_s=60.0, node_local=True)
    assert 24 - 8 + 7 > scale_clients.RUN_TURNS
    row = scale.run_case(case)
    assert row["not_measured"] is None, row["not_measured"]
    requests = row["saves"][0]["requests"]
    assert requests["get"] >= 2  # the two leaders without rank 0 read the manifest rank 0 offered


def test_a_case_over_its_budget_is_not_measured_and_says_so() -> None:
    row = scale.run_case(scale.Case(16, items=10, saves=1, workers=1, budget_s=0.01))
    assert row["not_measured"] and "budget" in row["not_measured"]
    cells = scale_report.table_rows([row])[0]
    assert cells[1] == "-" and cells[-1].startswith("not measured: ")


def test_collective_bytes_are_those_torch_object_collectives_move() -> None:
    values = {0: "root", 1: ["a" * 100], 2: None}
    sizes = {rank: len(pickle.dumps(obj)) for rank, obj in values.items()}
    world, rep = 5, [0, 1, 2, 2, 2]  # ranks 3 and 4 contribute what rank 2 does
    gathered = scale_clients.collective_result("all_gather", 0, None, values, world, rep)
    assert gathered[1][0] == ["root", ["a" * 100], None, None, None]
    assert gathered[1][1] == (world - 1) * (8 + max(sizes.values()))
    framed = scale_clients.collective_result("all_gather", 0, (16384, 8), values, world, rep)
    assert framed[2][1] == (world - 1) * 16384
    sent = scale_clients.collective_result("broadcast", 0, None, values, world, rep)
    assert sent[0] == ("root", 0) and sent[2] == ("root", 8 + sizes[0])
    to_root = scale_clients.collective_result("gather", 0, None, values, world, rep)
    assert to_root[0][1] > to_root[1][1] == (world - 1) * 8 and to_root[1][0] is None


def test_a_rank_blocked_gives_its_turn_up_and_no_more_than_the_turns_run_at_once() -> None:
    turns = scale_clients.Turns(2)
    lock, running, most = threading.Lock(), [0], [0]
    released, inside = threading.Event(), threading.Semaphore(0)

    def count(step: int) -> None:
        with lock:
            running[0] += step
            most[0] = max(most[0], running[0])

    def blocker() -> None:  # takes a turn, then blocks until the last rank ran
        turns.take()
        count(1)
        count(-1)
        with turns.blocked():
            inside.release()
            released.wait()
        count(1)
        count(-1)
        turns.give()

    def last() -> None:  # needs a turn while both blockers wait: only theirs are free
        turns.take()
        count(1)
        released.set()
        count(-1)
        turns.give()

    threads = [threading.Thread(target=blocker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:  # both hold no turn now, waiting inside blocked()
        assert inside.acquire(timeout=30)
    threads.append(threading.Thread(target=last))
    threads[-1].start()
    for thread in threads:
        thread.join(timeout=30)
    assert released.is_set() and not any(thread.is_alive() for thread in threads)
    assert 1 <= most[0] <= 2
    turns.give()  # no turn held on this thread: nothing happens

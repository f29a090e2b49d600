"""Random faults, at random moments and overlapping, while a job trains: the run and its checker.

`run` starts a registry, k dedicated summation servers and a standby (failover on), and n = 4 ranks of a workload
(benchmarks/cluster/workers/chaos_train.py: ddp, backup or async), then has the nemesis (benchmarks/chaos_nemesis.py)
play a seeded schedule of faults. Everything that happens goes to the run's record (JSON lines): the ranks' steps and
errors, each fault, servers' peak memory, the fault-free baseline's verdict (ddp) and what was left behind. `check`
reads a record and prints the table; it fails (exit 1) on a lost or duplicated update, replicas that differ, a hang
(no step for more than 2x the timeout), memory past the bound, leftovers, or a rank that failed, unless the fault
that failed it cannot be survived by design and every rank named the documented error.

    python -m benchmarks.chaos run --workload ddp --seed 1 --minutes 5 --record results/chaos-ddp.jsonl
    python -m benchmarks.chaos check results/chaos-ddp.jsonl

May import: the standard library, torch (the baseline's parameters), benchmarks.chaos_nemesis, benchmarks.cluster
and torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.chaos_nemesis import (  # noqa: E402
    FINAL,
    KINDS,
    LINK_FAULTS,
    MB,
    TOKEN_ENV,
    NamespaceSite,
    Nemesis,
    Pool,
    Settings,
    Site,
    schedule,
)
from benchmarks.cluster import netns, procs  # noqa: E402


# -- the run
class Record:
    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()

    def __call__(self, entry: dict) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def rank_env(s: Settings, rank: int, master: str, registry: str) -> dict:
    """A rank's environment; `master`: the job store's "host:port"."""
    host, port = master.rsplit(":", 1)
    return {"MASTER_ADDR": host, "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(s.workers),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0",
            "BPS_NUM_SERVERS": str(s.servers), "BPS_REGISTRY": registry, "BPS_PLACEMENT": "dedicated",
            "BPS_FAILOVER": "0" if s.workload == "backup" else "1", "BPS_TIMEOUT": str(s.timeout),
            "BPS_FAILOVER_TIMEOUT": str(3 * s.timeout),
            "BPS_HEARTBEAT_TIMEOUT": str(s.heartbeat), "BPS_HEARTBEAT_INTERVAL": str(s.heartbeat / 6),
            "BPS_STANDBY_WAIT": str(s.heartbeat)}  # fmt: skip


def run(s: Settings, record_path: str) -> int:
    """Run one workload under the nemesis, recording everything to `record_path`; return the checker's verdict."""
    os.environ.setdefault("BPS_POOL_CREDENTIAL", secrets.token_urlsafe(32))
    if threading.current_thread() is threading.main_thread():  # a SIGTERM (kill, timeout) still cleans up below
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    token, logdir = secrets.token_hex(6), tempfile.mkdtemp(prefix="bps-chaos-")
    shm_before = set(os.listdir("/dev/shm"))
    open(record_path, "w").close()
    record = Record(record_path)
    why = netns.unavailable_reason() if s.netns else "namespaces not asked for (--no-netns)"
    kinds = s.kinds or KINDS[s.workload] + tuple(k for w, k in FINAL.items() if w == s.workload)
    if why:
        kinds = tuple(k for k in kinds if k not in LINK_FAULTS)
    record({"meta": {**s.__dict__, "kinds": list(kinds), "link_faults_skipped": why, "token": token, "tree": tree()}})
    print(f"chaos: {s.workload}, seed {s.seed}, {s.seconds:.0f} s, faults {', '.join(kinds)}"
          + (f" (link faults skipped: {why})" if why else ""), flush=True)  # fmt: skip
    site = NamespaceSite(s.workers, s.servers + 1, logdir, token, s.rate_mbit) if not why else \
        Site(s.workers, s.servers + 1, logdir, token)  # fmt: skip
    run_id = getattr(getattr(site, "cluster", None), "run_id", None)
    result: dict = {}
    try:
        result = _run_on(site, s, kinds, record, record_path)
    finally:
        site.close()
        result["leftovers"] = leftovers(token, run_id, shm_before, [p.pid for p in site.procs])
        record({"result": result})
    return check(record_path)


def tree() -> str:
    """The commit the run's code is at ("-dirty" with uncommitted changes), so a table names the code it measured."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)  # fmt: skip
        return out.stdout.strip() or "unknown (not a git checkout)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def _run_on(site: Site, s: Settings, kinds, record: Record, record_path: str) -> dict:
    w0 = site.workers[0]
    registry, master = f"{w0.ip}:{site.port(w0)}", f"{w0.ip}:{site.port(w0)}"
    pool = Pool(site, s, registry, record)
    pool.store = site.registry(registry)  # held while the run lasts
    for proc in [pool.launch(host) for host in site.servers]:  # the first k to register are the job's, then a standby
        pool.ready(proc)
    worker = [sys.executable, "-m", "benchmarks.cluster.workers.chaos_train", "--workload", s.workload, "--record",
              record_path, "--seconds", str(s.seconds), "--backups", str(s.backups), "--step-sleep",
              str(s.step_sleep), "--rebalance-every", str(s.rebalance_every)]  # fmt: skip
    out = record_path + ".params.pt"
    ranks = [site.spawn(f"rank {r}", h, worker + (["--out", out] if r == 0 else []),
                        rank_env(s, r, master, registry)) for r, h in enumerate(site.workers)]  # fmt: skip
    nemesis = Nemesis(site, pool, ranks, s, record)
    began = _first_step(record_path, ranks, 300)
    plan = schedule(s, kinds)
    deadline = began + s.seconds + 20 * s.timeout  # the job stops on its own; past this, it hung
    while any(r.poll() is None for r in ranks) and time.time() < deadline:
        now = time.time() - began
        while plan and plan[0][0] <= now:
            nemesis.inject(plan.pop(0)[1])
        pool.sample()
        time.sleep(0.2)
    hung = [r.name for r in ranks if r.poll() is None]
    nemesis.join(60)
    exits = {r.name: r.poll() for r in ranks}
    for r in ranks:
        r.kill()
    result = {"exits": exits, "hung_ranks": hung, "errors": {r.name: r.stderr_tail(8) for r in ranks
                                                             if exits[r.name] not in (0, -9)}}  # fmt: skip
    if s.workload == "ddp" and not hung and exits.get("rank 0") == 0:
        result["baseline"] = baseline(site, s, pool, record_path, out)
    result["memory"] = {a: {"start": st, "peak": pk} for a, (st, pk) in pool.peak.items()}
    pool.stop_all()
    return result


def _first_step(record_path: str, ranks: list, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(record_path) as f:
            if any('"step": 0' in line for line in f):
                return time.time()
        if any(r.poll() is not None for r in ranks):
            break
        time.sleep(0.2)
    raise TimeoutError(f"the ranks did not complete a first step within {timeout:.0f} s: "
                       + "; ".join(f"{r.name}: {r.stderr_tail(5)}" for r in ranks))  # fmt: skip


def baseline(site: Site, s: Settings, pool: Pool, record_path: str, chaos_out: str) -> dict:
    """Run the ddp workload again, as many steps, with no fault (servers given, failover off); compare bits."""
    import torch

    steps = _steps_done(record_path)
    addresses = [v.address for v in pool.live()][: s.servers]
    base_record, out = record_path + ".baseline", record_path + ".baseline.pt"
    worker = [sys.executable, "-m", "benchmarks.cluster.workers.chaos_train", "--workload", "ddp", "--record",
              base_record, "--steps", str(steps)]  # fmt: skip
    master = f"{site.workers[0].ip}:{site.port(site.workers[0])}"
    env = {"BPS_SERVERS": ",".join(addresses), "BPS_FAILOVER": "0", "BPS_NUM_SERVERS": "0", "BPS_REGISTRY": ""}
    ranks = [site.spawn(f"baseline rank {r}", h, worker + (["--out", out] if r == 0 else []),
                        {**rank_env(s, r, master, ""), **env})
             for r, h in enumerate(site.workers)]  # fmt: skip
    results = procs.wait_all(ranks, 60 + 2 * steps, "the fault-free baseline")
    chaos, base = torch.load(chaos_out), torch.load(out)
    differ = [n for n in base if not torch.equal(chaos[n], base[n])]
    return {"steps": steps, "baseline_steps": results[0]["steps"], "differ": differ}


def _steps_done(record_path: str) -> int:
    with open(record_path) as f:
        done = [e for e in map(json.loads, f) if e.get("event") == "done" and e.get("rank") == 0]
    return done[0]["steps"]


def leftovers(token: str, run_id: str | None, shm_before: set[str], pids: list[int]) -> dict:
    """What the run left behind: its processes (by token), its namespaces, new /dev/shm segments of its processes
    (a segment's name carries its maker's pid: another job's on this machine are not this run's)."""
    time.sleep(1.0)  # processes on their way out
    marker = f"{TOKEN_ENV}={token}".encode()
    left = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if name.isdigit() and marker in f.read().split(b"\0"):
                    with open(f"/proc/{name}/cmdline", "rb") as c:
                        cmd = c.read().replace(b"\0", b" ").decode(errors="replace")
                    left.append(f"{name}: {cmd[:120]}")
        except OSError:
            continue
    spaces = [n for n in netns.list_namespaces() if run_id and n.endswith(run_id)] if run_id else []
    shm = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if any(f"_{pid}_" in n for pid in pids))
    return {"processes": left, "namespaces": spaces, "shm": shm}


# -- the checker
def load(path: str) -> tuple[dict, list, list, dict]:
    meta, steps, faults, result = {}, [], [], {}
    with open(path) as f:
        for e in map(json.loads, f):
            if "meta" in e:
                meta = e["meta"]
            elif "fault" in e:
                faults.append(e)
            elif "result" in e:
                result = e["result"]
            elif "step" in e:
                steps.append(e)
    return meta, steps, faults, result


def verdict(path: str) -> dict:
    """Everything the table says, from the record at `path`."""
    meta, steps, faults, result = load(path)
    n, timeout = meta["workers"], meta["timeout"]
    by_rank = {r: [e for e in steps if e["rank"] == r and e["step"] >= 0] for r in range(n)}
    done = {e["rank"]: e for e in steps if e.get("event") == "done"}
    t0 = [e["t"] for e in by_rank[0]]
    out: dict = {"workload": meta["workload"], "seed": meta["seed"], "seconds": meta["seconds"],
                 "link_faults_skipped": meta["link_faults_skipped"], "steps": len(t0),
                 "tree": meta.get("tree", "not recorded")}  # fmt: skip
    exits = result.get("exits", {})
    out["unsurvivable"], expected = unsurvivable(meta, steps, faults, exits)
    faults = [f for f in faults if "expect" not in f]
    kinds: dict[str, list[int]] = {}
    recoveries, errors, unfinished = [], [], 0
    servers_at = job_servers(steps)
    for fault in faults:
        if "skipped" in fault or not t0 or fault["t"] > t0[-1]:  # none, or after the job's last step
            continue
        counted = kinds.setdefault(fault["fault"], [0, 0, 0])
        counted[0] += 1
        counted[2] += fault["fault"] == "worker_kill" or fault.get("target") in servers_at(fault["t"])
        after = [t for t in t0 if t > fault.get("cleared", fault["t"])]
        if "error" in fault:
            errors.append(f"{fault['fault']} {fault.get('target')}: {fault['error']}")
        elif after:
            counted[1] += 1
            recoveries.append(after[0] - fault.get("cleared", fault["t"]))
        else:
            unfinished += 1  # it cleared after the job's last step: nothing left to recover
    out["faults"] = kinds
    changes = next((e.get("failovers", []) for e in steps if e.get("event") == "done" and e["rank"] == 0), [])
    out["failovers"] = sum("epoch" in c for c in changes), sum("rebalance" in c for c in changes)
    out["fault_errors"] = errors
    out["cleared_after_end"] = unfinished
    out["recovery_s"] = (statistics.median(recoveries), max(recoveries)) if recoveries else None
    out["slow_recoveries"] = sum(r > 2 * timeout for r in recoveries)
    gaps = [b - a for a, b in zip(t0, t0[1:], strict=False)]
    out["longest_gap_s"] = max(gaps, default=0.0)
    out["hangs"] = sum(g > 2 * timeout for g in gaps) + len(result.get("hung_ranks", []))
    # Every rank's steps in order, and replicas alike at every step every live rank recorded.
    out_of_order = [r for r, es in by_rank.items() if [e["step"] for e in es] != list(range(len(es)))]
    crcs: dict[int, set] = {}
    for e in steps:
        if e["step"] >= 0 and meta["workload"] != "async":  # asynchronous replicas differ by design
            crcs.setdefault(e["step"], set()).add(e["crc"])
    out["out_of_order_ranks"] = out_of_order
    out["replicas_differ_at"] = sorted(step for step, c in crcs.items() if len(c) > 1)[:5]
    lost = dup = 0
    if meta["workload"] == "async":
        for r, e in done.items():
            counted, powers = round(-e["model"][r]), -e["model"][n + r]  # a whole number of updates, if exact
            lost += max(0, e["acked"] - counted) + (powers < e["powers"])
            dup += max(0, counted - e["acked"]) + (powers > e["powers"])
    out["lost"], out["duplicated"] = lost, dup
    base = result.get("baseline")
    out["baseline"] = ("bit-identical" if not base["differ"] else f"differs in {base['differ']}") if base else None
    killed = {name for name, code in exits.items() if code == -9}
    out["failed_ranks"] = {k: v for k, v in exits.items() if v not in (0, -9) and k not in expected}
    out["killed_ranks"] = sorted(killed)
    memory = result.get("memory", {})
    growth = max((m["peak"] - m["start"] for m in memory.values()), default=0)
    out["memory_growth_mib"], out["memory_bound_mib"] = growth / MB, meta["max_memory"] / MB
    out["left_behind"] = {k: v for k, v in result.get("leftovers", {}).items() if v}
    failures = []
    if out["lost"] or out["duplicated"]:
        failures.append("updates lost or duplicated")
    if out["hangs"]:
        failures.append("hangs")
    if out["out_of_order_ranks"] or out["replicas_differ_at"]:
        failures.append("replicas differ or rounds out of order")
    if base is not None and base["differ"] or meta["workload"] == "ddp" and base is None:
        failures.append("final parameters differ from the fault-free run's (or it did not run)")
    if out["failed_ranks"] or out["fault_errors"]:
        failures.append("a rank or a fault failed")
    if any(not ok for ok, _ in out["unsurvivable"].values()):
        failures.append("an unsurvivable fault did not end every rank with its documented error")
    if growth > meta["max_memory"]:
        failures.append("server memory past its bound")
    if out["left_behind"]:
        failures.append("left behind")
    if meta["workload"] == "async" and len(done) < n:
        failures.append("a rank did not report its model")
    out["failures"] = failures
    return out


def job_servers(steps: list):
    """A function of a time: the dedicated servers the job used then, as rank 0 recorded them (the servers it
    started on, then those of each failover and rebalance that had ended by then). A fault reached the job if it
    struck one of them, or a rank: the nemesis also strikes standbys, and servers a failover left behind."""
    start = next((set(e["servers"]) for e in steps if e.get("event") == "servers" and e["rank"] == 0), set())
    done = next((e for e in steps if e.get("event") == "done" and e["rank"] == 0), {})
    changes = sorted((c["t"], set(c["servers"])) for c in done.get("failovers", []) if "t" in c)

    def at(t: float) -> set[str]:
        return next((servers for when, servers in reversed(changes) if when <= t), start)

    return at


def unsurvivable(meta: dict, steps: list, faults: list, exits: dict) -> tuple[dict, set[str]]:
    """Faults that cannot be survived by design (FINAL): each must end every rank it did not find dead with the
    documented error, of that type and naming a server it struck. Returns, per such kind, (whether it did, a line
    that says so), and the ranks whose failure it explains (by name, as in `exits`)."""
    errors = {f"rank {e['rank']}": e for e in steps if e.get("event") == "error"}
    out, expected = {}, set()
    for kind in (k for k in meta["kinds"] if k in FINAL.values()):
        struck = [f for f in faults if f["fault"] == kind and "expect" in f]
        if not struck:
            out[kind] = (False, "planned, never injected (the job ended first)")
            continue
        want, targets = struck[0]["expect"], struck[0]["targets"]
        alive = [name for name in exits if exits[name] != -9]
        named = [name for name in alive if name in errors and errors[name]["type"] == want
                 and any(address in errors[name]["message"] for address in targets)]  # fmt: skip
        expected.update(named)
        wrong = {name: f"{errors[name]['type']}: {errors[name]['message'][:160]}" if name in errors else
                 f"exit {exits[name]}, no error recorded" for name in alive if name not in named}  # fmt: skip
        out[kind] = (not wrong and bool(alive), f"{want} naming a server it struck on {len(named)} of {len(alive)} "
                     "live ranks" + "".join(f"; {name}: {why}" for name, why in wrong.items()))  # fmt: skip
    return out, expected


def table(vs: list[dict]) -> str:
    """The checker's table: a row per measure, a column per run."""
    rows = list(zip(*(_rows(v) for v in vs), strict=True))
    width = max(len(row[0][0]) for row in rows)
    lines = [f"| {row[0][0]:<{width}} | " + " | ".join(b for _, b in row) + " |" for row in rows]
    if len(vs) > 1:
        lines[1:1] = ["| " + "-" * width + " |" + " --- |" * len(vs)]  # markdown: the first row is the header
    for v in vs:
        lines += [f"  fault error ({v['workload']}, seed {v['seed']}): {e}" for e in v["fault_errors"][:10]]
    return "\n".join(lines)


def _rows(v: dict) -> list[tuple[str, str]]:
    rec = v["recovery_s"]
    rows = [
        ("workload, seed, seconds", f"{v['workload']}, {v['seed']}, {v['seconds']:.0f}"),
        ("code (git describe)", v["tree"]),
        ("steps (rank 0)", str(v["steps"])),
        ("faults by kind (injected/recovered/reached the job)",
         ", ".join(f"{k} {a}/{b}/{c}" for k, (a, b, c) in sorted(v["faults"].items())) or "none"),
        ("faults in all; that reached the job; cleared after the last step",
         f"{sum(a for a, _, _ in v['faults'].values())} of {len(v['faults'])} kinds; "
         f"{sum(c for _, _, c in v['faults'].values())} of {sum(c > 0 for _, _, c in v['faults'].values())} kinds; "
         f"{v['cleared_after_end']}"),
        ("failovers; rebalances (rank 0)", "{}; {}".format(*v["failovers"])),
        ("link faults", "skipped: " + v["link_faults_skipped"] if v["link_faults_skipped"] else "on (namespaces)"),
        ("fault cleared to the next step, median / max", f"{rec[0]:.2f} s / {rec[1]:.2f} s" if rec else "n/a"),
        ("recoveries slower than 2x the timeout", str(v["slow_recoveries"])),
        ("longest step gap; hangs", f"{v['longest_gap_s']:.2f} s; {v['hangs']}"),
        ("updates lost / duplicated", f"{v['lost']} / {v['duplicated']}"),
        ("replicas differ at steps; ranks out of order", f"{v['replicas_differ_at']}; {v['out_of_order_ranks']}"),
        ("final parameters vs fault-free run", v["baseline"] or "n/a"),
        ("ranks killed by the nemesis; ranks failed", f"{v['killed_ranks']}; {v['failed_ranks']}"),
        ("unsurvivable faults: the documented error",
         "; ".join(f"{k}: {line}" for k, (_, line) in v["unsurvivable"].items()) or "none injected"),
        ("server memory growth, peak vs bound", f"{v['memory_growth_mib']:.1f} MiB vs {v['memory_bound_mib']:.0f} MiB"),
        ("left behind", json.dumps(v["left_behind"]) if v["left_behind"] else "nothing"),
        ("verdict", "FAIL: " + "; ".join(v["failures"]) if v["failures"] else "ok"),
    ]  # fmt: skip
    return rows


def check(*paths: str) -> int:
    """Print the table of the runs recorded at `paths`; 1 if any run failed."""
    vs = [verdict(path) for path in paths]
    print(table(vs), flush=True)
    return 1 if any(v["failures"] for v in vs) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="a workload under the nemesis, then the checker's table")
    r.add_argument("--workload", choices=sorted(KINDS), default="ddp")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--minutes", type=float, default=1.0)
    r.add_argument("--gap", type=float, default=Settings.gap, help="mean seconds between faults")
    r.add_argument("--kinds", default="", help="comma-separated subset of the kinds (default: all that apply)")
    r.add_argument("--no-netns", action="store_true", help="loopback even where namespaces are available")
    r.add_argument("--rebalance-every", type=int, default=0, help="ddp, async: rebalance every this many steps")
    r.add_argument("--record", default="", help="the record's path (default: a file in a fresh temporary folder)")
    c = sub.add_parser("check", help="the table of runs' records, a column each")
    c.add_argument("record", nargs="+")
    args = p.parse_args(argv)
    if args.command == "check":
        return check(*args.record)
    s = Settings(workload=args.workload, seed=args.seed, seconds=args.minutes * 60, gap=args.gap,
                 kinds=tuple(k for k in args.kinds.split(",") if k), netns=not args.no_netns,
                 rebalance_every=args.rebalance_every)  # fmt: skip
    path = args.record or os.path.join(tempfile.mkdtemp(prefix="bps-chaos-record-"), "record.jsonl")
    print(f"record: {path}", flush=True)
    return run(s, path)


if __name__ == "__main__":
    sys.exit(main())

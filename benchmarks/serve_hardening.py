"""Issue #19's audit of `k3 serve`, re-measured: a real server process on 127.0.0.1 with a random tiny checkpoint,
tried as a hostile but fair user would.

    python benchmarks/serve_hardening.py [--fuzz 2400] [--out benchmarks/results/serve-hardening]

Rounds (every loop is bounded in count and time; traffic goes to 127.0.0.1 only; the server is our own child
process, stopped by its PID):
  fuzz         N random bodies (hypothesis-free: a seeded generator of OpenAI-ish fields with hostile values)
               -> counts by status code, how many 5xx were not JSON, whether the engine is alive afterwards
  sampling     the reproducers of item 1 (temperature / top_p 1e-300, 5e-324, 1e-39), both endpoints, streamed or not
  concurrency  64 concurrent greedy streams -> how many equal their solo run
  disconnects  320 streams dropped after 4 events, and 20 non-streamed requests dropped after 0.3 s -> aborts seen,
               slots/pages held at the end, server RSS before and after
  overload     100 simultaneous requests against --max-waiting 8 -> counts by status code
  body         a 20 MB chat body -> status and seconds, and the worst /health latency meanwhile
  template     the template attacks of item 4 against a second server whose checkpoint ships them (one at a time)
  sigterm      seconds from SIGTERM (with a stream running) to exit, and how the stream ended

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx2
from report import write_report

HOSTILE_NUMBERS = [0, 1, -1, 2, 7, 1e-300, 5e-324, 1e-39, 1e308, 2**63, 2**64, 0.5, True, False, None]
HOSTILE_TEXT = ["hi", "", "\ud800", "a\udfffb", "<|eos|>", "{{ 7*7 }}", "x" * 5000, "\x00", "🙂"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
          "logprobs", "top_logprobs", "stream_options", "logit_bias", "tools", "tool_choice", "response_format",
          "echo", "user"]  # fmt: skip


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if kind < 0.4 or depth > 1:
        return rng.choice(HOSTILE_NUMBERS)
    if kind < 0.7:
        return rng.choice(HOSTILE_TEXT)
    if kind < 0.85:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["role", "content", "type", "text", "include_usage"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _fuzz_body(rng: random.Random, chat: bool) -> bytes:
    body = {f: _value(rng) for f in rng.sample(FIELDS, rng.randint(0, 6))}
    if chat:
        body.setdefault("messages", [{"role": "user", "content": rng.choice(HOSTILE_TEXT)}])
    else:
        body.setdefault("prompt", rng.choice(HOSTILE_TEXT))
    body["max_tokens"] = body["max_tokens"] if body.get("max_tokens") in (1, 2) else 2
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # truncated JSON
    return raw


class Server:
    """`k3 serve` as a child process on a free loopback port."""

    def __init__(self, ckpt: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--ckpt", ckpt, "--port",
                                      str(self.port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx2.TransportError:
                time.sleep(0.2)
        raise RuntimeError("k3 serve did not start")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _count(codes) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[str(c)] = out.get(str(c), 0) + 1
    return dict(sorted(out.items()))


def fuzz(srv: Server, n: int) -> dict:
    rng, codes, not_json = random.Random(0), [], 0
    with httpx2.Client(base_url=srv.base, timeout=60) as http:
        for i in range(n):
            chat = rng.random() < 0.5
            r = http.post("/v1/chat/completions" if chat else "/v1/completions", content=_fuzz_body(rng, chat),
                          headers={"content-type": "application/json"})  # fmt: skip
            codes.append(r.status_code)
            if r.status_code >= 400:
                try:
                    assert "error" in r.json()
                except Exception:  # noqa: BLE001
                    not_json += 1
        alive = http.get("/health").status_code == 200
    return {"bodies": n, "status_codes": _count(codes), "errors_not_json": not_json, "alive_after": alive}


def sampling(srv: Server) -> dict:
    results = []
    with httpx2.Client(base_url=srv.base, timeout=60) as http:
        for settings in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-39}):
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
                for stream in (False, True):
                    r = http.post(path, json={**body, **settings, "max_tokens": 4, "stream": stream})
                    results.append(r.status_code)
        alive = http.get("/health").json()
    return {"requests": len(results), "status_codes": _count(results), "health_after": alive}


def concurrency(srv: Server, n: int = 64) -> dict:
    prompts = [f"Question {i}: why are caches hard?" for i in range(n)]
    body = lambda p, stream: {"messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0,  # noqa: E731
                              "stream": stream}  # fmt: skip
    with httpx2.Client(base_url=srv.base, timeout=120) as http:
        solo = [http.post("/v1/chat/completions", json=body(p, False)).json()["choices"][0]["message"]["content"]
                for p in prompts]  # fmt: skip

    async def run():
        async with httpx2.AsyncClient(base_url=srv.base, timeout=300,
                                      limits=httpx2.Limits(max_connections=n)) as client:  # fmt: skip
            async def one(p):
                text = ""
                async with client.stream("POST", "/v1/chat/completions", json=body(p, True)) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:]).get("choices", []):
                                text += c["delta"].get("content") or ""
                return text

            return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    streamed = asyncio.run(run())
    return {"streams": n, "identical_to_solo": sum(a == b for a, b in zip(streamed, solo)),
            "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip


def disconnects(srv: Server, rounds: int = 320) -> dict:
    def metric(name: str) -> float:
        text = httpx2.get(f"{srv.base}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    rss_before, aborts_before = srv.rss_mb(), metric('openk3_requests_total{outcome="abort"}')
    for r in range(rounds):
        body = {"messages": [{"role": "user", "content": f"tell me everything {r}"}], "max_tokens": 300,
                "temperature": 0, "stream": True}  # fmt: skip
        with httpx2.Client(timeout=30) as http, http.stream("POST", f"{srv.base}/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            for _ in range(4):
                next(lines)
    dropped = 20
    for r in range(dropped):
        try:
            httpx2.post(f"{srv.base}/v1/completions", json={"prompt": f"long {r}", "max_tokens": 300}, timeout=0.3)
        except httpx2.TimeoutException:
            pass
    time.sleep(1.0)
    return {"streams_dropped": rounds, "non_streamed_dropped": dropped,
            "aborts_seen": metric('openk3_requests_total{outcome="abort"}') - aborts_before,
            "running_at_end": metric("openk3_num_requests_running"), "slots_used_at_end": metric("openk3_cache_slots_used"),
            "rss_mb_before": round(rss_before), "rss_mb_after": round(srv.rss_mb())}  # fmt: skip


def overload(srv: Server) -> dict:
    async def run():
        async with httpx2.AsyncClient(base_url=srv.base, timeout=300,
                                      limits=httpx2.Limits(max_connections=100)) as client:  # fmt: skip
            return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 8})
                                          for i in range(100)))  # fmt: skip

    return {"simultaneous": 100, "max_waiting": 8, "status_codes": _count(r.status_code for r in asyncio.run(run()))}


def big_body(srv: Server) -> dict:
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * (20 * 2**20)}]}).encode()
    result, worst = {}, 0.0

    def post():
        start = time.perf_counter()
        r = httpx2.post(f"{srv.base}/v1/chat/completions", content=raw, timeout=300,
                        headers={"content-type": "application/json"})  # fmt: skip
        result.update(status=r.status_code, seconds=round(time.perf_counter() - start, 2))

    t = threading.Thread(target=post)
    t.start()
    while t.is_alive():
        start = time.perf_counter()
        httpx2.get(f"{srv.base}/health", timeout=120)
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.05)
    return {**result, "worst_health_s": round(worst, 3)}


TEMPLATES = {
    "nested loop": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "range(10**9)": "{% for i in range(10**9) %}x{% endfor %}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",
    "sandbox violation": "{{ messages.__class__.__mro__ }}",
    "10 GB string": "{{ 'x' * 10**10 }}",
}


def templates(ckpt_root: str, make_ckpt) -> list[dict]:
    rows = []
    for name, source in TEMPLATES.items():
        ckpt = make_ckpt(os.path.join(ckpt_root, name.replace(" ", "_").replace("*", "")))
        with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
            f.write(source)
        srv = Server(ckpt, "--template-timeout", "2")
        try:
            start = time.perf_counter()
            r = httpx2.post(f"{srv.base}/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            seconds = time.perf_counter() - start
            other = httpx2.post(f"{srv.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            rows.append({"template": name, "status": r.status_code, "json": "error" in r.json(),
                         "seconds": round(seconds, 2), "next_request": other.status_code,
                         "message": r.json()["error"]["message"][:90]})  # fmt: skip
        finally:
            srv.stop()
    return rows


def sigterm(ckpt: str) -> dict:
    srv = Server(ckpt, "--shutdown-timeout", "2", "--max-model-len", "4096")
    try:
        body = {"prompt": [5] * 8, "max_tokens": 4000, "stream": True, "temperature": 0}
        with httpx2.Client(timeout=60) as http, http.stream("POST", f"{srv.base}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(lines)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        code = srv.proc.wait(timeout=30)
        return {"seconds_to_exit": round(time.monotonic() - start, 2), "exit_status": code,
                "stream_ended_with": rest[-2:]}  # fmt: skip
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzz", type=int, default=2400)
    ap.add_argument("--out", default="benchmarks/results/serve-hardening")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3-hardening-") as root:  # the checkpoints, removed at the end
        results = _measure(root, args.fuzz)
    write_report(results, args.out, _markdown(results))


def _measure(root: str, n_fuzz: int) -> dict:
    from openk3 import K3Config, K3ForCausalLM

    def make_ckpt(path: str) -> str:
        model = K3ForCausalLM(K3Config.preset("tiny"))
        model.init_random_weights(0)
        model.save_pretrained(path)
        return path

    ckpt = make_ckpt(os.path.join(root, "tiny"))
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "python": platform.python_version()}  # fmt: skip
    srv = Server(ckpt, "--max-model-len", "384")
    try:
        for name, fn in (("fuzz", lambda: fuzz(srv, n_fuzz)), ("sampling", lambda: sampling(srv)),
                         ("concurrency", lambda: concurrency(srv)), ("disconnects", lambda: disconnects(srv)),
                         ("body", lambda: big_body(srv))):  # fmt: skip
            start = time.perf_counter()
            results[name] = fn()
            print(f"{name}: {results[name]} ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        srv.stop()
    srv = Server(ckpt, "--max-waiting", "8", "--max-num-seqs", "2")
    try:
        results["overload"] = overload(srv)
        print("overload:", results["overload"], flush=True)
    finally:
        srv.stop()
    results["template"] = templates(root, make_ckpt)
    print("template:", results["template"], flush=True)
    results["sigterm"] = sigterm(ckpt)
    print("sigterm:", results["sigterm"], flush=True)
    return results


def _markdown(r: dict) -> str:
    lines = ["# `k3 serve` hardening audit, re-measured", "",
             f"`python benchmarks/serve_hardening.py` on {r['machine']}, Python {r['python']}; a random tiny "
             "checkpoint served by a `k3 serve` child process on 127.0.0.1.", "",
             "| round | what was sent | result |", "|---|---|---|"]  # fmt: skip
    fz = r["fuzz"]
    lines.append(f"| fuzz | {fz['bodies']} random bodies | status codes {fz['status_codes']}; 5xx/4xx not JSON: "
                 f"{fz['errors_not_json']}; engine alive after: {fz['alive_after']} |")
    sm = r["sampling"]
    lines.append(f"| sampling | temperature/top_p 1e-300, 5e-324, 1e-39 on both endpoints, streamed and not "
                 f"({sm['requests']}) | status codes {sm['status_codes']}; /health after: {sm['health_after']} |")
    cc = r["concurrency"]
    lines.append(f"| concurrency | {cc['streams']} concurrent greedy streams | {cc['identical_to_solo']}/"
                 f"{cc['streams']} identical to their solo run, {cc['seconds']} s |")
    dc = r["disconnects"]
    lines.append(f"| disconnects | {dc['streams_dropped']} streams dropped after 4 events, {dc['non_streamed_dropped']}"
                 f" non-streamed dropped after 0.3 s | aborts seen {dc['aborts_seen']:.0f}; running at end "
                 f"{dc['running_at_end']:.0f}; slots used at end {dc['slots_used_at_end']:.0f}; RSS "
                 f"{dc['rss_mb_before']} -> {dc['rss_mb_after']} MB |")
    ov = r["overload"]
    lines.append(f"| overload | {ov['simultaneous']} simultaneous, --max-waiting {ov['max_waiting']} | status codes "
                 f"{ov['status_codes']} |")
    bd = r["body"]
    lines.append(f"| body | a 20 MB chat body | {bd['status']} in {bd['seconds']} s; worst /health meanwhile "
                 f"{bd['worst_health_s']} s |")
    for t in r["template"]:
        lines.append(f"| template | {t['template']} (--template-timeout 2) | {t['status']} JSON={t['json']} in "
                     f"{t['seconds']} s; next request {t['next_request']}; \"{t['message']}\" |")
    sg = r["sigterm"]
    lines.append(f"| sigterm | SIGTERM with a stream running (--shutdown-timeout 2) | exited in "
                 f"{sg['seconds_to_exit']} s (status {sg['exit_status']}); the stream ended with "
                 f"`{' / '.join(sg['stream_ended_with'])}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

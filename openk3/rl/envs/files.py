"""The files family: questions about a generated workspace, answered with the ls, cat and grep tools.

The workspace: `conf/<service>/<name>.ini` files of `key = value` lines under a `[service]` header (2-3 services,
1-2 files each, 3-4 keys a file; every key is used once in the whole tree and occurs in exactly one line of it), and
`logs/<name>.log` files of `hh:mm LEVEL message` lines. Three kinds of question, each with a one-call shortest
demonstration:

    value  "What is the value of `port` in conf/web/main.ini?"    cat(path) -> the file; answer: the value
    count  "How many lines of logs/app.log contain ERROR?"        grep(pattern, path, count=true) -> n; answer: n
    find   "Which value does `port` have? It is set in one file    grep(pattern, "conf") -> "path:port = v";
            under conf/."                                           answer: v

`value` uses cat rather than a one-line grep so that every tool appears in the demonstrations; all three copy the
answer from the observation. Reward: exact match of the stripped final content (envs.exact_match). A guess (no
tool) answers a value of the right kind drawn at random: a small count, or a config value from the vocabulary.
"""

from __future__ import annotations

import random

from openk3.rl.envs import Task, assistant, call, draw, exact_match, tool_message
from openk3.rl.tools import schemas

SERVICES = ("db", "cache", "web", "auth", "queue", "mail", "api", "search", "billing", "stats")
CONF_FILES = ("main.ini", "local.ini", "prod.ini", "base.ini", "extra.ini")
KEYS = ("timeout", "port", "host", "user", "retries", "workers", "region", "bucket", "loglevel", "mode", "charset",
        "backlog", "quota", "maxconn", "poolsize", "replicas", "shards", "keepalive", "prefix", "encoding", "tls",
        "cert", "salt", "token", "realm", "domain", "proxy", "gateway", "zone", "tier", "owner", "group", "limit",
        "delay", "interval", "buffer", "batch", "window", "codec", "engine", "driver", "schema", "channel")  # fmt: skip
WORDS = ("fast", "slow", "alpha", "beta", "blue", "green", "gold", "north", "south", "pg", "redis", "kafka", "utf8",
         "gzip", "strict", "lax", "on", "off", "eu", "us", "ap", "primary", "backup", "admin", "svc")  # fmt: skip
LOG_FILES = ("app.log", "web.log", "worker.log", "db.log", "auth.log", "cron.log")
LEVELS = ("INFO", "INFO", "WARN", "ERROR", "DEBUG")
MESSAGES = ("disk full", "user login", "cache miss", "job done", "conn reset", "slow query", "retry send",
            "cert expired", "queue empty", "token refresh", "backup ok", "rate limited")  # fmt: skip
KINDS = ("value", "count", "find")
TOOLS = schemas("ls", "cat", "grep")


def _value(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return str(rng.randint(1, 9999))
    if kind == 1:
        return rng.choice(WORDS)
    return f"{rng.choice(WORDS)}-{rng.randint(1, 99)}"


def _workspace(rng: random.Random) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(files, {conf path: {key: value}})."""
    keys = iter(rng.sample(KEYS, len(KEYS)))
    files: dict[str, str] = {}
    conf: dict[str, dict[str, str]] = {}
    for service in rng.sample(SERVICES, rng.randint(2, 3)):
        for name in rng.sample(CONF_FILES, rng.randint(1, 2)):
            path = f"conf/{service}/{name}"
            conf[path] = {next(keys): _value(rng) for _ in range(rng.randint(3, 4))}
            files[path] = f"[{service}]\n" + "".join(f"{k} = {v}\n" for k, v in conf[path].items())
    for name in rng.sample(LOG_FILES, rng.randint(1, 2)):
        lines = [f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {rng.choice(LEVELS)} {rng.choice(MESSAGES)}"
                 for _ in range(rng.randint(5, 9))]  # fmt: skip
        files[f"logs/{name}"] = "\n".join(lines) + "\n"
    return files, conf


def _unique_keys(files: dict[str, str], conf: dict[str, dict[str, str]]) -> bool:
    """Every key occurs (as a substring) in exactly one line of the conf tree: grep finds it and nothing else."""
    lines = [line for path, text in files.items() if path.startswith("conf/") for line in text.splitlines()]
    return all(sum(key in line for line in lines) == 1 for keys in conf.values() for key in keys)


class Files:
    name = "files"

    def generate(self, split: str, index: int) -> Task:
        return draw(self.name, split, index, lambda rng: self._make(rng, f"{self.name}/{split}/{index}"))

    def _make(self, rng: random.Random, task_id: str) -> Task:
        files, conf = _workspace(rng)
        while not _unique_keys(files, conf):
            files, conf = _workspace(rng)
        kind = rng.choice(KINDS)
        if kind == "count":
            path = rng.choice(sorted(p for p in files if p.startswith("logs/")))
            lines = files[path].splitlines()
            pattern = rng.choice(lines).split(" ", 2)[rng.choice((1, 2))]  # a level or a message
            answer = str(sum(pattern in line for line in lines))
            prompt = f"How many lines of {path} contain {pattern}?"
            meta = {"kind": kind, "path": path, "pattern": pattern}
        else:
            path = rng.choice(sorted(conf))
            key = rng.choice(sorted(conf[path]))
            answer = conf[path][key]
            if kind == "value":
                prompt = f"What is the value of `{key}` in {path}?"
            else:
                prompt = f"Which value does `{key}` have? It is set in one file under conf/."
            meta = {"kind": kind, "path": path, "key": key}
        return Task(self.name, task_id, prompt, files, answer, TOOLS, meta)

    def verify(self, task: Task, sandbox, final_message: dict) -> float:
        return exact_match(task, final_message)

    def demonstration(self, task: Task) -> list[dict]:
        kind, path = task.meta["kind"], task.meta["path"]
        if kind == "value":
            c, observation = call("call_0", "cat", path=path), task.files[path].rstrip("\n")
        elif kind == "count":
            c, observation = call("call_0", "grep", pattern=task.meta["pattern"], path=path, count=True), task.answer
        else:
            key = task.meta["key"]
            c, observation = call("call_0", "grep", pattern=key, path="conf"), f"{path}:{key} = {task.answer}"
        name = c["function"]["name"]
        return [assistant("", c), tool_message("call_0", name, observation), assistant(task.answer)]

    def guess(self, task: Task, rng: random.Random) -> list[dict]:
        return [assistant(str(rng.randint(1, 5)) if task.meta["kind"] == "count" else _value(rng))]

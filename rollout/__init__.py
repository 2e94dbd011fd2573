"""Rollouts over a task set through any harness: `molt-proxy rollout` and its Python API.

A task set is a JSONL file (`rollout.tasks`); each task runs `attempts` times as one group, each
attempt in a session of its own created on the proxy, in a fresh workspace (`rollout.workspace`,
optionally sandboxed: `rollout.sandbox`), by a harness (`rollout.harness`: one adapter file per
harness under `rollout/harnesses/`); the task's check (`rollout.checks`) turns the workspace into
a reward, which the runner (`rollout.runner`) posts, and a results JSONL (`rollout.results`) makes
a rerun resume. `rollout.progress` shows the run, `rollout.command` is `molt-proxy rollout`.
See docs/rollout.md.
"""

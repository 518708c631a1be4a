"""Test-only fault injection for tests/multiprocess/test_sync_failure.py: pause a rank at an exact point of the loop.

megarl has no test hooks of its own. This file is put first on PYTHONPATH of a
`megarl train` run, so every Python process of the job (the launcher and each
spawned rank) imports it at start-up; it then patches two megarl functions as
they are imported, and only when its variables are set:

    MEGARL_TEST_PAUSE_DIR=D                 where the markers go (required)
    MEGARL_TEST_PAUSE_SYNC_VERSION=N        a generator rank receiving policy version N stops *inside*
                                            the weight sync: the senders' headers have arrived (the
                                            trainer ranks are sending), no payload has landed yet.
                                            It writes D/sync_paused ("<pid> <version>") and sleeps.
                                            Trainer ranks record each send: D/send<version>.rank<RANK>
                                            holds "started", then "finished" once it returned.
    MEGARL_TEST_PAUSE_SAVE_ITERATION=N      trainer rank 0 saving iteration N stops once every rank's
                                            files are in the staging directory, before the manifest
                                            is written and the directory renamed into place. It
                                            writes D/save_paused ("<pid> <iteration>") and sleeps.

Each rank also writes D/rank<RANK>.pid ("<pid> <role>") when its heartbeat starts,
so the test finds the generator rank's process without guessing.

A sleeping rank sleeps until the test kills a process of the job; the job's
own failure handling does the rest -- which is what the test observes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

_DIR = os.environ.get("MEGARL_TEST_PAUSE_DIR")


def _pause(name: str, what: str) -> None:
    path = os.path.join(_DIR, name)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {what}\n")
    os.replace(path + ".tmp", path)
    while True:  # until killed
        time.sleep(3600)


def _patch_transport(module) -> None:
    version = os.environ.get("MEGARL_TEST_PAUSE_SYNC_VERSION")
    if version is None:
        return
    receiver = module.WeightReceiver
    receive, exchange = receiver.receive, receiver._exchange

    def paused_receive(self, expected_version=None):
        self._test_pause_after_header = expected_version == int(version)
        return receive(self, expected_version)

    def paused_exchange(self, ops):
        exchange(self, ops)
        if getattr(self, "_test_pause_after_header", False):  # the first exchange of receive: the headers
            self._test_pause_after_header = False
            _pause("sync_paused", version)

    receiver.receive, receiver._exchange = paused_receive, paused_exchange

    send = module.WeightSender.send

    def marked_send(self, v):  # the trainer side: D/send<v>.rank<RANK>, "started" then "finished"
        path = os.path.join(_DIR, f"send{v}.rank{os.environ.get('RANK')}")
        with open(path, "w") as f:
            f.write("started\n")
        stats = send(self, v)
        with open(path, "a") as f:
            f.write("finished\n")
        return stats

    module.WeightSender.send = marked_send


def _patch_manifest(module) -> None:
    iteration = os.environ.get("MEGARL_TEST_PAUSE_SAVE_ITERATION")
    if iteration is None:
        return
    finish = module.finish_manifest

    def paused_finish(staging, world, it):
        if it == int(iteration):
            _pause("save_paused", iteration)
        return finish(staging, world, it)

    module.finish_manifest = paused_finish


def _patch_heartbeat(module) -> None:
    init = module.Heartbeat.__init__

    def marked_init(self, store, rank, world_size, role, *args, **kwargs):
        init(self, store, rank, world_size, role, *args, **kwargs)
        with open(os.path.join(_DIR, f"rank{rank}.pid"), "w") as f:
            f.write(f"{os.getpid()} {role}\n")

    module.Heartbeat.__init__ = marked_init


_PATCHES = {
    "megarl.weight_sync.transport": _patch_transport,
    "megarl.checkpointing.manifest": _patch_manifest,
    "megarl.runtime.heartbeat": _patch_heartbeat,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _DIR:
    sys.meta_path.insert(0, _PatchAfterImport())

"""A worker's micro-batches: its stream shards read in order, chained across epochs, cut
to the micro-batch, collated (ahead, in a thread, where that pays) and timed.

The stream orders its rows itself, as a function of the data alone, so that a resumed run
sees the order an uninterrupted one does; nothing here shuffles.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import ray.train
import ray.train.torch
import torch

from pipeline.training.train_config import TrainConfig


def training_batches(shard, train: TrainConfig, micro_batch_size: int):
    """A worker's micro-batches from its stream shard (a Ray ``DataIterator``), in stream
    order: the stream orders its rows itself, as a function of the data alone, so that a
    resumed run sees the order an uninterrupted one does (a local shuffle buffer would
    shuffle what is left after a resume differently)."""
    return shard.iter_batches(
        batch_size=micro_batch_size,
        batch_format="numpy",
        prefetch_batches=train.prefetch_batches,
        drop_last=False,
    )


def shard_batches(name: str, train: TrainConfig, micro_batch_size: int):
    """:func:`training_batches` of dataset ``name``'s shard, asked of Ray Train only now: each
    shard asked starts a split coordinator (an actor) for its dataset, so the datasets of
    later epochs cost nothing before their turn. Every rank asks in the same order."""
    return training_batches(ray.train.get_dataset_shard(name), train, micro_batch_size)


def chained(parts: list, batch_size: int) -> Iterator:
    """The batches of ``parts`` (each a zero-argument callable giving an iterator of numpy
    batches), one part after another, cut again into batches of ``batch_size`` rows across
    the parts' ends: an epoch's last rows share a batch with the next epoch's first, as in
    one stream. The next part is started, and its first batch fetched, in a thread once the
    current one's first batch is taken: an epoch's stream prepares itself while the one
    before it trains."""
    if len(parts) == 1:
        yield from parts[0]()
        return

    def started(i: int):
        batches = iter(parts[i]())
        return batches, next(batches, None)

    def joined():
        pool = ThreadPoolExecutor(1, thread_name_prefix="next-part")
        try:
            ahead = pool.submit(started, 0)
            for i in range(len(parts)):
                batches, first = ahead.result()
                if first is not None:
                    yield first
                # Started once the first batch is taken, so the next epoch's join does not
                # compete with the stream's start for the node's CPUs.
                if i + 1 < len(parts):
                    ahead = pool.submit(started, i + 1)
                yield from batches  # nothing left when the part had no first batch
        finally:  # a run that stops early (max_steps) does not wait for the next part's start
            pool.shutdown(wait=False, cancel_futures=True)

    yield from rebatched(joined(), batch_size)


def rebatched(batches: Iterator[dict], size: int) -> Iterator[dict]:
    """``batches`` (dicts of equally long arrays) as batches of ``size`` rows, in order, the
    last one shorter if the rows run out. A full batch passes through uncopied."""
    pending: dict | None = None
    for batch in batches:
        if pending is not None:
            batch = {key: np.concatenate([pending[key], batch[key]]) for key in batch}
        rows = len(next(iter(batch.values())))
        whole = rows - rows % size
        for start in range(0, whole, size):
            yield batch if rows == size else {key: values[start : start + size] for key, values in batch.items()}
        pending = {key: values[whole:] for key, values in batch.items()} if whole < rows else None
    if pending is not None:
        yield pending


def collated(batches, make_batch, seed_of, first_micro_step: int, ahead: bool):
    """Each micro-batch with its tensors: ``make_batch(batch, generator)``, the generator
    seeded by ``seed_of(micro_step)``, micro-steps counting from ``first_micro_step``. With
    ``ahead``, the next batch is made in a thread while the caller trains on this one, so
    masking and collation leave the step's critical path. The tensors are the same either
    way: ``make_batch`` draws from its generator only."""

    def make(batch, micro_step: int):
        return make_batch(batch, torch.Generator().manual_seed(seed_of(micro_step)))

    micro_steps = itertools.count(first_micro_step)
    if not ahead:
        for batch in batches:
            yield batch, make(batch, next(micro_steps))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="collate") as pool:
        pending = None
        for batch in batches:
            made = pool.submit(make, batch, next(micro_steps))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (batch, made)
        if pending is not None:
            yield pending[0], pending[1].result()


def timed(batches, waited: list[float]):
    """``batches``, adding the time each ``next`` blocks to ``waited[0]``."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        waited[0] += time.perf_counter() - started
        yield batch

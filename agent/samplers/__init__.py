"""Samplers: each reads one kind of source and fills a :class:`agent.samples.Batch`.

One sampler per file. The daemon runs each on its own thread and schedule, with a timeout,
so a slow or failing sampler never delays the others.
"""

"""The local multi-node Ray cluster of the tests that span nodes (replicas, ranks on Ray nodes).

A head node with no CPUs (nothing of ours is placed there) and worker nodes
with one CPU each, so one replica or rank lands on each node; small object
stores and no dashboard, to fit beside the other tests on two cores.
"""

from __future__ import annotations

import logging

import ray
from ray.cluster_utils import Cluster

NODE_STORE = 80 << 20   # bytes of object store per node


def add_worker_node(cluster):
    """One more one-CPU worker node in ``cluster`` (its node handle)."""
    return cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)


def two_node_cluster(namespace=None):
    """``(cluster, [node, node])``: a started cluster with two worker nodes, this process connected to it."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": NODE_STORE, "include_dashboard": False})
    nodes = [add_worker_node(cluster) for _ in range(2)]
    ray.init(address=cluster.address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    return cluster, nodes


def stop_cluster(cluster) -> None:
    """Disconnect this process and shut ``cluster`` down."""
    try:
        ray.shutdown()
    finally:
        cluster.shutdown()

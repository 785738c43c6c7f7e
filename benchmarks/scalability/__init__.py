"""The scalability suite: the experiments of the pDomus paper (section 4)
on hosts made of network namespaces, with Redis Cluster and MariaDB
baselines in the same run, the YCSB core workloads, and a model fitted to
the measured costs.

    python -m benchmarks.scalability [--quick] [--delay-us 50] [--json FILE]
                                     [--png-dir DIR] [--only domus,redis,...]

Needs root (ip netns, veth pairs, a bridge).  See benchmarks/README.md.
"""

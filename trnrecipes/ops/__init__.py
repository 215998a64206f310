"""Operating a cluster job: the pre-flight and between-restart health check of a node's device and collectives
(health.py) and AWS's nccom-test (nccom.py).

Imports config/, parallel/ and backends/; never train/.
"""

"""Operating a cluster job: the pre-flight of a job's interpreter, packages, devices and files (doctor.py, standard
library only at the top), the health check of a node's device and collectives (health.py) and AWS's nccom-test
(nccom.py).

Imports config/, jobs/, parallel/ and backends/; never train/.
"""

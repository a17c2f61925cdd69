"""Ray: where each actor runs and how the driver reaches it.

``services`` starts engines and reward workers in placement groups and fans work out to them; ``learner_group``
the learner's ranks as one fail-fast group; ``weight_sync`` the weight sync as one object; ``placement`` roles on
nodes (``*.node_resources``, ``placement.json``, the live-cluster check); ``node_files`` the same files on every
node; ``devices`` where the learner and engines ran; ``local_head`` a private Ray head on this machine and the
Jobs API client; ``local_cluster`` a multi-node Ray on this machine (``gspo-cluster``); ``user_code`` user
verifier modules, checked on the driver and shipped to workers; ``console`` what the terminal shows versus the
run's log files.
"""

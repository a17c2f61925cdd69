"""Ray: where each actor runs and how the driver reaches it.

``services`` starts engines and reward workers in placement groups and fans work out to them; ``learner_group``
the learner's ranks as one fail-fast group; ``local_head`` a private Ray head on this machine and the Jobs API
client; ``user_code`` user verifier modules, checked on the driver and shipped to workers; ``console`` what the
terminal shows versus the run's log files.
"""

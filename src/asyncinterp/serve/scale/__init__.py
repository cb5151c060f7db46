"""Scale-out, the top floor of serving: N replicas on Ray Serve, and tensor-parallel ranks (local or on Ray nodes).

Each of these starts or fronts whole servers (:mod:`asyncinterp.serve.http`):
:mod:`.replicas` and :mod:`.ray_app` (Ray Serve), :mod:`.replica_loss` (a
replica dying under a request), :mod:`.tp_serve`, :mod:`.tp_ray` and
:mod:`.tp_front` (a sharded model's ranks and their front). Imports run only
downward: nothing below imports this floor.
"""

"""Replicas of the server on Ray Serve behind one endpoint (`colibri serve --replicas N`).

`prefix` holds the routing decision (no Ray), `router` the Ray Serve request router over it,
`listing` what GET /v1/replicas shows (no Ray), `deployments` the ingress and replica
deployments, `launch` what `colibri serve` runs. Only
`launch` and `deployments` are imported from outside, and only when replicas are asked for:
a single server never imports Ray.
"""

"""The org node's admin REST API (FastAPI).

:func:`api.app.create_app` ``(settings, node)`` builds it from one
:class:`api.settings.Settings` and the running node's
:class:`org_node.services.NodeServices`. Everything lives under ``/v1`` except
``/healthz``, ``/readyz`` and ``/metrics``; every route but the first two needs a bearer
token, and each declares the roles it admits:

==============================  =========================  ==========================
resource                        read                       write
==============================  =========================  ==========================
node, peers, federation         admin, operator, auditor   proposals/signing: admin
tokens                          admin                      admin
datasets, runs                  admin, operator, auditor   admin, operator
policies                        admin, operator, auditor   admin
checkpoints                     admin, operator, auditor   verify: +operator; restore: admin
audit                           admin, auditor             (written by the node only)
==============================  =========================  ==========================

Authentication failures are one opaque 401; a token of another role gets 403; an
action a run's state does not allow gets 409 naming that state.

The top layer: it may import every other (``org_node``, ``coordinator_free``,
``secure_agg``), and nothing imports it but the console script. :mod:`api.serve` is
the composition root that serves the admin API and the peer port in one process.
"""

__all__: list[str] = []

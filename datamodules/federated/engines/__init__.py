"""Gradient engines: per-sample and per-client gradients of a client's loss, each fast path next to
the obvious reference it is tested against (`next_token`: text; `classification`: images and
tables; `transformer3`: the specialised engine of the LTI paper's model)."""

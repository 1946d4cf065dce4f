"""The candidate-pointer attack: a learned inverter over the span test's candidates (issue 34).

A RoPE target's first-layer span test names an update's bag of tokens but not their order
(`exact.span_evidence.CandidateEvidence`). `evidence_file` computes the candidates of many simulated
updates once and stores them; `pointer` is the plain-PyTorch network that orders them; `module` its
Lightning wrapper; `cli` the `lti candidates build|fit|evaluate` commands, their options the
dataclasses of `options` (parsed by `lti.command_line`, which `lti matrix` shares).
"""

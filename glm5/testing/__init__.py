"""The conformance kit vendors run against their plugin: generators per op (cases), the one
tolerance table (tolerances), the float64-oracle comparison (compare), the parity runner behind
`glm5 parity` (parity) and a pytest plugin: `pytest --pyargs glm5.testing --glm5-backend NAME`."""

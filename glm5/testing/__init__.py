"""The conformance kit vendors run against their plugin: generators per op (cases), the one
tolerance table (tolerances, derived from each op's error model in glm5.ir.numerics), the
float64-oracle comparison (compare: ``check_example`` runs a kernel, ``judge`` /
``assert_matches`` judge outputs computed elsewhere — what tests use instead of tolerances of
their own), the parity runner behind `glm5 parity` (parity) and a pytest plugin:
`pytest --pyargs glm5.testing --glm5-backend NAME`."""

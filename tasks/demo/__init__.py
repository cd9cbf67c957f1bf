"""The demo's fixtures: generated pictures with captions that name what they show (`data`), and
tiny models in the hub layout that load through the real `from_pretrained` path (`models`). Used by
`precast demo`, the tests and the benchmarks; no stage imports them."""

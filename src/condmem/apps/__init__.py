"""Applications on top of the library: the demo (`condmem.apps.demo`), the study
(`condmem.apps.study`) and their plots (`condmem.apps.plots`).

Each is driven by a typed config (`DemoConfig`, `StudyConfig`) and built from
`condmem.train` and `condmem.models`; nothing in the library imports this package.
"""

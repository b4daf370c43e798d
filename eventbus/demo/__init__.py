"""End-to-end demonstrations of eventbus on real data (``eventbus demo ...``).

`eventbus.demo.flights` is the main job: the 336,776 flights of NYC in 2013 through a bus.
"""

"""The fleet: RPC trackers, devices provisioned over SSH, and what is running where.

`edgetune fleet up|status|down RECIPE` manage what a recipe's targets are measured on; `edgetune
build` then measures each remote target on its tracker key (see edgetune.tuning.remote).
"""

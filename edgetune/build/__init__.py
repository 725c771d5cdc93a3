"""One target's build: the context its stages share (context.py) and the stages in pipeline order:
tune, compile, measure, package, verify. edgetune/pipeline.py orders them per target."""

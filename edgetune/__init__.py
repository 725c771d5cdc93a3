"""edgetune: tune a model for a fleet of edge devices with Apache TVM and package deployable artifacts."""

__version__ = "0.1.0"

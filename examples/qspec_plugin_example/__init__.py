"""A worked example of qspec plug-ins living in their own package (docs/extending.md): a prompt-lookup
speculator and an absmax quantizer, named by ``module:attr`` or by this package's entry points."""

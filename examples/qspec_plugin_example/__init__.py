"""A worked example of qspec plug-ins living in their own package (docs/extending.md): a prompt-lookup
speculator, an absmax quantizer and a calibrated clip-search quantizer, named by ``module:attr`` or by this
package's entry points."""

"""The job config tree: the section base and its errors, and every section model. Imports only
`core`."""

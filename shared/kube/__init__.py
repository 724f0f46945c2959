"""The one way to the Kubernetes API: `client` (kubeconfig, in-cluster or URL+token; one session,
no per-request proxy lookups), `rest` (raw JSON requests and watches, the one ApiError), `versions`
(which resource.k8s.io version the server serves)."""

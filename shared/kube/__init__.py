"""The one way to the Kubernetes API, for the services and the embedded world alike:

- `client`: the ApiClient (kubeconfig, in-cluster, or URL + token; one session, no per-request proxy
  lookups; KubeConfigError when none can be made);
- `rest`: raw JSON requests and watch streams on it, and the one `ApiError` (with `Gone` for 410);
- `resources`: typed resource paths (`Resource`, PODS, RESOURCECLAIMS, ...) and `Kube`, plain-dict
  list/get/create/replace/patch/delete/watch over them;
- `informer`: one resource's objects kept current by list + watch (bookmarks, relist on 410 Gone);
- `versions`: which resource.k8s.io version the server serves.
"""

"""The models the gateway serves: discovered from etcd, each a pipeline over remote workers."""

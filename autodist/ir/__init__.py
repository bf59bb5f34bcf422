"""The IR: GraphItem, ResourceSpec and Strategy, their validation, and capture."""

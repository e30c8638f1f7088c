"""The experts of a mixture-of-experts model: traces of which ones each layer routes to (`trace`), and the
policies that decide which of them a GPU's memory keeps, replayed against those traces (`simulate`)."""

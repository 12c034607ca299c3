// depthsat book

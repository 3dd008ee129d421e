# Colibri: the OpenAI-compatible server on a slim Python base.
# Builds the C extension (gcc), installs the package, serves on 0.0.0.0:8000.
#   docker build -t colibri .
#   docker run --rm -p 8000:8000 colibri                          # the bundled demo model
#   docker run --rm -p 8000:8000 -v /models/m:/model colibri --model /model --api-key KEY
FROM python:3.12-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .
RUN pip install --no-cache-dir . && rm -rf /src/build

RUN useradd --create-home colibri
USER colibri
WORKDIR /home/colibri
ENV COLIBRI_HOST=0.0.0.0 \
    COLIBRI_PORT=8000 \
    COLIBRI_CACHE_DIR=/home/colibri/.cache/colibri/models
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/ready').status != 200)"
ENTRYPOINT ["colibri", "serve"]
CMD ["--host", "0.0.0.0"]

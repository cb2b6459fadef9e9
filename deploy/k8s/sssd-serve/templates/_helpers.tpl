{{/* Names, labels and shared pieces of the sssd-serve chart. */}}

{{- define "sssd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sssd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: <fullname>-<component>. */}}
{{- define "sssd.component" -}}
{{- printf "%s-%s" (include "sssd.fullname" .root) .component -}}
{{- end -}}

{{- define "sssd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{ include "sssd.selectorLabels" . }}
{{- end -}}

{{- define "sssd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sssd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sssd.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- printf "%s:%s-%s" .Values.image.repository $tag .Values.image.variant -}}
{{- end -}}

{{- define "sssd.container" -}}
image: {{ include "sssd.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{/* A container on a GPU node: the image's cuda variant, whatever image.variant says. */}}
{{- define "sssd.gpuContainer" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
image: {{ printf "%s:%s-cuda" .Values.image.repository $tag }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{- define "sssd.podSpec" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The probes against the standard gRPC health service: Kubernetes' native gRPC probe, or
with TLS (which it cannot speak) `sssd-health-probe` verifying the component's Service name.
Arguments: root, name (the Service), port, initialDelay. */}}
{{- define "sssd.grpcProbes" -}}
{{- if .root.Values.tls.secretName -}}
readinessProbe:
  exec:
    command: ["sssd-health-probe", "--port", {{ .port | quote }}, "--server-name", {{ .name | quote }}]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  exec:
    command: ["sssd-health-probe", "--port", {{ .port | quote }}, "--server-name", {{ .name | quote }}]
  initialDelaySeconds: {{ .initialDelay | default 10 }}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
{{- else -}}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc:
    port: {{ .port }}
  initialDelaySeconds: {{ .initialDelay | default 10 }}
  periodSeconds: 10
  failureThreshold: 6
{{- end }}
{{- end -}}

{{/* TLS (values tls.secretName): the environment every sssd process reads its files from, the
mount and the volume. Each renders nothing without TLS. */}}
{{- define "sssd.tlsEnv" -}}
{{- if .Values.tls.secretName -}}
- {name: SSSD_TLS_CERT, value: /etc/sssd/tls/tls.crt}
- {name: SSSD_TLS_KEY, value: /etc/sssd/tls/tls.key}
- {name: SSSD_TLS_CA, value: /etc/sssd/tls/ca.crt}
{{- end }}
{{- end -}}

{{- define "sssd.tlsMount" -}}
{{- if .Values.tls.secretName -}}
- {name: tls, mountPath: /etc/sssd/tls, readOnly: true}
{{- end }}
{{- end -}}

{{- define "sssd.tlsVolume" -}}
{{- if .Values.tls.secretName -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 288  # 0440: the pods' group (fsGroup) reads it
{{- end }}
{{- end -}}

{{- define "sssd.redisSecret" -}}
{{- default (include "sssd.component" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "sssd.rayAuthSecret" -}}
{{- default (include "sssd.component" (dict "root" . "component" "ray-auth")) .Values.verifier.auth.existingSecret -}}
{{- end -}}

{{/*
The Redis URL as an env var list. The chart's Redis: SSSD_REDIS_PASSWORD from the Secret, which
every sssd client adds to a URL without one (sssd.indexer.redis_server.connect), so the password
never appears on a command line. An external URL is used as given, or read from its Secret.
*/}}
{{- define "sssd.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: SSSD_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "sssd.redisSecret" . }}
      key: {{ .Values.redis.auth.key }}
- name: SSSD_REDIS_URL
  value: {{ printf "redis://%s:%d/0" (include "sssd.component" (dict "root" . "component" "redis")) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.externalUrlSecret.name }}
- name: SSSD_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret.name }}
      key: {{ .Values.redis.externalUrlSecret.key }}
{{- else }}
- name: SSSD_REDIS_URL
  value: {{ .Values.redis.externalUrl | quote }}
{{- end }}
{{- end -}}

{{- define "sssd.shardClaim" -}}
{{- default (include "sssd.component" (dict "root" . "component" "shards")) .Values.shards.existingClaim -}}
{{- end -}}

{{/* The live datastore directory on the shard volume. */}}
{{- define "sssd.datastoreDir" -}}/shards/datastore{{- end -}}

{{/*
A value for an environment variable: YAML numbers reach templates as floats, and 1000000 would
print as 1e+06, which an int field cannot read; whole numbers print as integers.
*/}}
{{- define "sssd.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . | quote -}}
{{- else -}}
{{- . | quote -}}
{{- end -}}
{{- end -}}
